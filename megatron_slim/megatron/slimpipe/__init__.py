"""SlimPipe on megatron-core model chunks: the schedule function Megatron's ``train()`` calls
(``schedule``) and the slice-aware core attention it runs (``slicing``)."""

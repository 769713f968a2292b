"""megatron-slim's context-parallel engines inside megatron-core models: the core attention
(``attention``), the remap layer (``remap_layer``), the per-pack batch split (``data``, ``lengths``,
``padding``), the hooks that plug them into Megatron-LM (``hooks``) and CP under SlimPipe
(``schedule``)."""

"""Building blocks on megatron-core: Llama-style GPT chunks on CPU (``gpt``), their weights, rotary
table, RNG tracker, process groups and optimizer, and the core-attention seam and spec rewriter
that SlimPipe and the CP engines plug into."""

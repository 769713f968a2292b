"""DynMo inside Megatron-LM's own loop (``python -m megatron_slim.launch ... --dynmo-*``): per-layer
profiling and layer freezing on the model and optimizer ``pretrain()`` built (``hooks``)."""

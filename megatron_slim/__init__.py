"""megatron-slim: SlimPipe, Zeppelin, SlimPack and DynMo for Megatron-LM."""

__version__ = "0.1.0"

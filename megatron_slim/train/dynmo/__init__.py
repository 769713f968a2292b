"""The dynamic models and per-layer profiling of ``megatron-slim train`` (the recipe's ``dynmo:`` section)."""

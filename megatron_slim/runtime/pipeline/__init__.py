"""The pipeline runtime: an interpreter of the planning core's schedule IR.

Megatron-agnostic: model chunks, the forward step and the backward step come in as callables, so
the same interpreter runs Megatron-LM's ``pretrain_gpt.py`` (``megatron_slim.megatron.slimpipe.schedule``)
and ``megatron-slim train``.
"""

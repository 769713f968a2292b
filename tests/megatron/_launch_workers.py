"""Rank function: run the stand-in pretrain_gpt.py through `python -m megatron_slim.launch`."""
import os
import sys

STANDIN = os.path.join(os.path.dirname(__file__), "standin")


def launch(rank, world_size, flags):
    sys.path.insert(0, STANDIN)
    from megatron_slim import launch as launcher

    try:
        launcher.main([os.path.join(STANDIN, "pretrain_gpt.py"), *flags])
    except Exception as exc:  # report user-facing errors to the parent as values
        from megatron_slim.plan.schema import ConfigError

        if isinstance(exc, ConfigError):
            return {"error": str(exc)}
        raise
    from megatron.training import training
    from megatron_slim.megatron.slicing import SliceCoreAttention

    model = training.LAST_RUN["model"]
    attentions = [type(m).__name__ for chunk in model for m in chunk.modules() if "CoreAttention" in type(m).__name__
                  or "DotProductAttention" in type(m).__name__]
    return {"losses": training.LAST_RUN["losses"], "functions": training.LAST_RUN["functions"],
            "attentions": attentions, "all_slice": all(isinstance(m, SliceCoreAttention) for chunk in model
                                                       for m in chunk.modules() if "Attention" in type(m).__name__
                                                       and "CoreAttention" in type(m).__name__)}


def launch_many(rank, world_size, flag_sets):
    """Start-up rejections only: each set must fail while parsing, before any model exists."""
    return [launch(rank, world_size, flags) for flags in flag_sets]

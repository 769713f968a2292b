"""The autotuner behind ``megatron-slim plan``: candidate space (``space``), bounds that prune
without changing the answer (``bounds``), branch and bound per schedule family (``search``) and
the two-family comparison (``tuner``)."""

from megatron_slim.plan.tune.tuner import TuneResult, tune

__all__ = ["TuneResult", "tune"]

"""Start-up rules of ``megatron-slim train``'s CPU training loop."""

from __future__ import annotations

from megatron_slim.plan.schema import fail
from megatron_slim.plan.startup.rule import Rule
from megatron_slim.plan.startup.settings import TRAIN

TRAIN_RULES = [
    Rule(
        "cpu-sequence-parallel",
        (TRAIN,),
        lambda s: s.sequence_parallel,
        lambda s, i: (
            "parallel.sequence_parallel: megatron-core's sequence-parallel buffers are CUDA-only; allowed on CPU "
            "ranks: false"
        ),
    ),
    Rule(
        "cpu-recompute",
        (TRAIN,),
        lambda s: s.recompute is not None,
        lambda s, i: (
            f"train.recompute: got {s.recompute!r}; the CPU training loop does not recompute activations (the models "
            "here are small; Megatron-LM does, through megatron-args with schedule.kind=1f1b or interleaved); "
            "allowed: none"
        ),
    ),
    Rule(
        "cpu-offload",
        (TRAIN,),
        lambda s: s.offload_ratio > 0,
        lambda s, i: (
            f"train.offload_ratio: got {s.offload_ratio}; the CPU training loop does not offload activations "
            "(the simulator prices it); allowed: 0"
        ),
    ),
    Rule(
        "cpu-precision",
        (TRAIN,),
        lambda s: s.precision != "fp32",
        lambda s, i: "train.precision: CPU ranks train in fp32; allowed: fp32",
    ),
    Rule(
        "train-evaluates",
        (TRAIN,),
        lambda s: bool(s.eval_iters),
        lambda s, i: (
            f"train.eval_iters: got {s.eval_iters}; megatron-slim train does not evaluate (Megatron-LM's loop does, "
            "see megatron-args); allowed here: 0"
        ),
    ),
    Rule(
        "train-slices-under-cp",
        (TRAIN,),
        lambda s: s.cp > 1 and s.slimpipe,
        lambda s, i: str(
            fail(
                "schedule.num_slices",
                s.num_slices,
                f"1 with parallel.cp > 1 and cp.engine={s.cp_engine}",
                "SlimPipe slices are not supported with this CP engine"
                if s.cp_engine != "ring"
                else "megatron-slim train does not wire SlimPipe x CP slices (query-out attention over the whole "
                "window, no document masking) yet; here cp.engine=ring runs whole packs of documents",
            )
        ),
    ),
]

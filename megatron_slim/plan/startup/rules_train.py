"""Start-up rules of ``megatron-slim train``'s CPU training loop."""

from __future__ import annotations

from megatron_slim.plan.recipe_sections import MEGATRON_CP_ENGINE, SLICED_CP_ENGINES, CPEngine
from megatron_slim.plan.schema import fail
from megatron_slim.plan.startup.rule import Rule
from megatron_slim.plan.startup.rules_slimpipe import EXCHANGE_CP_ENGINE
from megatron_slim.plan.startup.settings import NO_CP_ENGINE, TRAIN, Settings

# what megatron-core's selective recomputation runs on CPU with megatron_slim's core attention
TRAIN_RECOMPUTE_MODULES = ("core_attn", "mlp")


def _cp_attention(s: Settings) -> str:
    """Which CP attention the training loop runs: an engine, or SlimPipe's own for packed windows."""
    return f"cp.engine={s.cp_engine}" if s.cp_engine != NO_CP_ENGINE else "SlimPipe's query-out attention"


# what megatron-slim train runs under parallel.cp > 1: megatron-slim's engines
TRAIN_CP_ENGINES = tuple(e for e in CPEngine.__args__ if e != MEGATRON_CP_ENGINE)  # type: ignore[attr-defined]


def _query_out_cp(s: Settings) -> bool:
    """SlimPipe's own zigzag query-out CP attention runs: packed windows (no engine), or context
    exchange's (``Recipe.exchange_cp``, which ``cp.engine=ring`` names)."""
    exchange = s.slimpipe and s.slice_policy == "exchange" and s.cp_engine == EXCHANGE_CP_ENGINE
    return s.cp_engine == NO_CP_ENGINE or exchange


TRAIN_RULES = [
    Rule(
        "train-megatron-cp",
        (TRAIN,),
        lambda s: s.cp > 1 and s.cp_engine == MEGATRON_CP_ENGINE,
        lambda s, i: str(
            fail(
                "cp.engine",
                s.cp_engine,
                f"{' | '.join(TRAIN_CP_ENGINES)} with parallel.cp={s.cp}, or parallel.cp=1 (cp.engine=megatron "
                "launches through megatron-args)",
                "Megatron-LM's own context parallelism runs in Transformer Engine on GPUs; megatron-core's local "
                "attention, which megatron-slim train's CPU ranks build, refuses parallel.cp > 1",
            )
        ),
    ),
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
        "cpu-recompute-modules",
        (TRAIN,),
        lambda s: s.recompute == "selective" and not set(s.recompute_modules) <= set(TRAIN_RECOMPUTE_MODULES),
        lambda s, i: (
            f"train.recompute_modules: got {list(s.recompute_modules)}; the CPU training loop runs megatron-core's "
            "selective recomputation of the attention kernel and the MLP (layernorm needs Transformer Engine's "
            "checkpointing, the MoE and MLA modules layers this model lacks); allowed: a list of "
            f"{', '.join(TRAIN_RECOMPUTE_MODULES)}"
        ),
    ),
    Rule(
        "cpu-recompute-cp",
        (TRAIN,),
        lambda s: s.cp > 1 and (s.recompute is not None or s.offload_ratio > 0) and not _query_out_cp(s),
        lambda s, i: (
            f"train.recompute={s.recompute or 'none'}, train.offload_ratio={s.offload_ratio} with parallel.cp={s.cp}: "
            f"the context-parallel attention ({_cp_attention(s)}) is not checked under recomputation or offloading "
            "here; allowed with parallel.cp > 1: SlimPipe's own query-out CP attention (schedule.kind=slimpipe "
            "with schedule.num_slices > 1 and data.packing other than none, or schedule.slice_policy=exchange "
            f"with cp.engine={EXCHANGE_CP_ENGINE}), or train.recompute=none and train.offload_ratio=0"
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
        lambda s: s.cp > 1 and s.slimpipe and s.cp_engine != NO_CP_ENGINE and s.cp_engine not in SLICED_CP_ENGINES,
        lambda s, i: str(
            fail(
                "cp.engine",
                s.cp_engine,
                f"one of {', '.join(SLICED_CP_ENGINES)} with schedule.num_slices > 1 (each window planned once, "
                "every slice's query-out attention following the plan and reading the K/V of the same documents' "
                "earlier slices), or schedule.num_slices=1 (schedule.kind=1f1b or interleaved), which runs "
                f"cp.engine={s.cp_engine} on one planned pack per microbatch",
                "SlimPipe slices under this engine are not checked against the single-process reference yet",
            )
        ),
    ),
]

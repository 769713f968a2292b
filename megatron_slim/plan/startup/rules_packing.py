"""Start-up rules of ``--slimpipe-packing`` (the launcher's packed windows, ``megatron/data/packed_windows``).

Tensor and context parallelism run: Megatron's TP batch broadcast carries tensors only, so the
SlimPipe schedule hands each window's documents from TP rank 0 to the other TP ranks itself
(``megatron/slimpipe/stage.py``); every CP rank reads the whole window and SlimPipe's query-out CP
attention keeps to its documents.

What cannot work, and why:

* virtual pipeline stages: ``pretrain_gpt.get_batch`` reads batches on the first and last stages
  only; with pp > 2 the first stage hands each microbatch's document lengths to the middle stages
  (``runtime/pipeline/stage_lengths``), which needs one model chunk per rank;
* micro-batch size above 1: a packed window is one row;
* without ``--use-slimpipe``: Megatron's own schedule attends causally across the whole window;
* without ``--calculate-per-token-loss``: Megatron would divide each window's loss by its own token
  count (and by 0 on an all-padding window), not by the global batch's;
* ``--dataloader-type`` other than ``single``: the cyclic sampler shuffles windows across ranks and
  iterations, which breaks the fixed per-rank, per-iteration plan;
* Megatron's own packing (``--sequence-packing``) or hybrid-CP scheduler in the same run.
"""

from __future__ import annotations

from typing import Callable

from megatron_slim.plan.startup.rule import Rule
from megatron_slim.plan.startup.settings import LAUNCHER, Settings

PACKING_METHODS = ("none", "slimpack", "megatron", "bfd")


def _packing(name: str, broken: Callable[[Settings], bool], message: Callable[[Settings], str]) -> Rule:
    return Rule(name, (LAUNCHER,), lambda s: s.packing != "none" and broken(s), lambda s, i: message(s))


def _flag(s: Settings) -> str:
    return f"--slimpipe-packing {s.packing}"


PACKING_RULES = [
    Rule(
        "packing-method",
        (LAUNCHER,),
        lambda s: s.packing not in PACKING_METHODS,
        lambda s, i: f"--slimpipe-packing: got {s.packing!r}; allowed: {', '.join(PACKING_METHODS)}",
    ),
    _packing(
        "packing-needs-slimpipe",
        lambda s: not s.slimpipe,
        lambda s: (
            f"{_flag(s)}: needs --use-slimpipe (its slice attention keeps each document to itself); "
            "allowed: add --use-slimpipe, or --slimpipe-packing none"
        ),
    ),
    _packing(
        "packing-pipeline",
        lambda s: s.vpp > 1,
        lambda s: (
            f"{_flag(s)} with --pipeline-model-parallel-size {s.pp} (virtual {s.vpp}): the first stage hands "
            "each microbatch's documents to the middle stages for one model chunk per rank; allowed: "
            "--pipeline-model-parallel-size any without virtual stages (--virtual-pipeline-model-parallel-size 1)"
        ),
    ),
    _packing(
        "packing-micro-batch",
        lambda s: s.micro_batch_size != 1,
        lambda s: (
            f"{_flag(s)} with --micro-batch-size {s.micro_batch_size}: a packed window is one row; "
            "allowed: --micro-batch-size 1"
        ),
    ),
    _packing(
        "packing-per-token-loss",
        lambda s: not s.per_token_loss,
        lambda s: (
            f"{_flag(s)}: needs --calculate-per-token-loss (windows differ in loss tokens, and an "
            "all-padding window has none; the loss is the global batch's per-token mean only with it)"
        ),
    ),
    _packing(
        "packing-dataloader",
        lambda s: s.dataloader_type not in (None, "single"),
        lambda s: (
            f"{_flag(s)} with --dataloader-type {s.dataloader_type}: the packing plan fixes each "
            "rank's windows per iteration; allowed: --dataloader-type single"
        ),
    ),
    _packing(
        "packing-megatron-schedulers",
        lambda s: s.sequence_packing or s.hybrid_cp,
        lambda s: (
            f"{_flag(s)} replaces Megatron's own packing scheduler: drop --sequence-packing and "
            "--hybrid-context-parallel"
        ),
    ),
]

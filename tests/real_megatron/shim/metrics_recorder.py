"""Record what Megatron's own loop computed, at full precision (test harness only).

Megatron prints ``lm loss`` with 7 significant digits and ``grad norm`` with 3 decimals; comparing
schedules to 1e-5 needs the values themselves. ``install`` wraps ``training_log`` (called once per
iteration on every rank with that iteration's reduced losses and grad norm) and ``evaluate``
(returns the averaged evaluation losses) in ``megatron.training.training``. Each train record also
carries ``time``, the rank's ``time.perf_counter()`` when Megatron logged the iteration, so the
difference between consecutive records is that iteration's wall time on the rank.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time


def _number(value):
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().float()
        return float(value.item()) if value.numel() == 1 else [float(x) for x in value.flatten()]
    return float(value)


def _write(record: dict) -> None:
    path = os.path.join(os.environ["MEGATRON_SLIM_TEST_RECORD"], f"rank{os.environ.get('RANK', '0')}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def install(training) -> None:
    training_log = training.training_log
    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def recording_training_log(*args, **kwargs):
        now = time.perf_counter()
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        _write(
            {
                "kind": "train",
                "iteration": int(a["iteration"]),
                "loss": {k: _number(v) for k, v in (a["loss_dict"] or {}).items()},
                "grad_norm": _number(a.get("grad_norm")),
                "skipped": int(a.get("skipped_iter") or 0),
                "time": now,
            }
        )
        return training_log(*args, **kwargs)

    evaluate = training.evaluate
    calls = {"n": 0}

    @functools.wraps(evaluate)
    def recording_evaluate(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        total_loss_dict = result[0] if isinstance(result, tuple) else result
        calls["n"] += 1
        _write(
            {"kind": "eval", "call": calls["n"], "loss": {k: _number(v) for k, v in (total_loss_dict or {}).items()}}
        )
        return result

    training.training_log = recording_training_log
    training.evaluate = recording_evaluate

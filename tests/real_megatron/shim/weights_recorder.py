"""Record a digest of every decoder layer's weights after each training step (test harness only).

With ``MEGATRON_SLIM_TEST_LAYER_WEIGHTS=1`` (and ``MEGATRON_SLIM_TEST_RECORD=DIR``), ``install``
wraps ``train_step`` in ``megatron.training.training``: after each call every rank appends
``{"kind": "layer_weights", "iteration": N, "layers": {global layer: {parameter: sha256}}}`` to
``DIR/rank<R>.jsonl``, N counted from 1 as Megatron logs it. The digest is of the exact bytes, so
equal digests mean bit-identical weights. Beside it, ``{"kind": "layer_grads", ...}`` records per
layer and parameter the sum of ``|main_grad|`` (DDP's reduced gradient, 0.0 when DDP's hook never
added to it) and whether ``param.grad`` is None and ``requires_grad`` is set.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os


def _digests(model) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out: dict = {}
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                out[str(module.layer_number - 1)] = {
                    name: hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
                    for name, p in module.named_parameters()
                }
    return out


def _grads(model) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out: dict = {}
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                out[str(module.layer_number - 1)] = {
                    name: {
                        "main_grad_abs_sum": float(p.main_grad.abs().sum()) if hasattr(p, "main_grad") else None,
                        "grad_is_none": p.grad is None,
                        "requires_grad": p.requires_grad,
                    }
                    for name, p in module.named_parameters()
                }
    return out


def install(training) -> None:
    train_step = training.train_step
    signature = inspect.signature(train_step)

    @functools.wraps(train_step)
    def recording_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        from megatron.training.global_vars import get_args

        model, iteration = signature.bind(*args, **kwargs).arguments["model"], int(get_args().curr_iteration) + 1
        records = [
            {"kind": "layer_weights", "iteration": iteration, "layers": _digests(model)},
            {"kind": "layer_grads", "iteration": iteration, "layers": _grads(model)},
        ]
        path = os.path.join(os.environ["MEGATRON_SLIM_TEST_RECORD"], f"rank{os.environ.get('RANK', '0')}.jsonl")
        with open(path, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        return result

    training.train_step = recording_train_step

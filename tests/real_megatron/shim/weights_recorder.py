"""Record a digest of every decoder layer's weights after each training step (test harness only).

With ``MEGATRON_SLIM_TEST_LAYER_WEIGHTS=1`` (and ``MEGATRON_SLIM_TEST_RECORD=DIR``), ``install``
wraps ``train_step`` in ``megatron.training.training``: after each call every rank appends
``{"kind": "layer_weights", "iteration": N, "layers": {global layer: {parameter: sha256}}}`` to
``DIR/rank<R>.jsonl``, N counted from 1 as Megatron logs it. The digest is of the exact bytes, so
equal digests mean bit-identical weights.
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


def install(training) -> None:
    train_step = training.train_step
    signature = inspect.signature(train_step)

    @functools.wraps(train_step)
    def recording_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        from megatron.training.global_vars import get_args

        record = {
            "kind": "layer_weights",
            "iteration": int(get_args().curr_iteration) + 1,
            "layers": _digests(signature.bind(*args, **kwargs).arguments["model"]),
        }
        path = os.path.join(os.environ["MEGATRON_SLIM_TEST_RECORD"], f"rank{os.environ.get('RANK', '0')}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    training.train_step = recording_train_step

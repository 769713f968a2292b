"""Which optimizer parameters stand for a model parameter, across Megatron's optimizer classes.

Megatron's optimizers step *main* parameters, not the model's: ``FP32Optimizer`` steps the model
parameters themselves, ``Float16OptimizerWithFloat16Params`` fp32 copies of the bf16/fp16 ones, and
the ``DistributedOptimizer`` fp32 shards (views of this data-parallel rank's range of a parameter;
a parameter outside the rank's range has none). ``ChainedOptimizer`` holds several of these. The
pairs come from each class's parallel group lists (model group i, entry j <-> main group i, entry j).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch

# (model groups, main groups) attribute pairs, by optimizer class
_GROUP_PAIRS = (
    ("model_float16_groups", "shard_fp32_from_float16_groups"),  # DistributedOptimizer
    ("model_float16_groups", "shard_float16_groups"),  # DistributedOptimizer, precision-aware
    ("model_fp32_groups", "shard_fp32_groups"),  # DistributedOptimizer
    ("float16_groups", "fp32_from_float16_groups"),  # Float16OptimizerWithFloat16Params
)


def sub_optimizers(optimizer) -> list:
    """The optimizers a (possibly chained) Megatron optimizer steps."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _pairs(optimizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for model_attr, main_attr in _GROUP_PAIRS:
        models, mains = getattr(optimizer, model_attr, None), getattr(optimizer, main_attr, None)
        if not models or not mains:
            continue
        for model_group, main_group in zip(models, mains):
            for model_param, main_param in zip(model_group, main_group):
                if main_param is not None:
                    yield model_param, main_param
    inner = getattr(optimizer, "optimizer", None)
    for group in getattr(inner, "param_groups", []):
        for param in group["params"]:  # FP32Optimizer and fp32 params of Float16: the model's own
            yield param, param


class MainParams:
    """``model parameter -> [(inner torch optimizer, main parameter), ...]`` of a Megatron optimizer."""

    def __init__(self, optimizer) -> None:
        self._by_model: dict[int, list[tuple[object, torch.Tensor]]] = defaultdict(list)
        self._subs: dict[int, list[object]] = defaultdict(list)  # the Megatron optimizer of each entry
        for sub in sub_optimizers(optimizer):
            seen: set[int] = set()
            for model_param, main_param in _pairs(sub):
                if id(main_param) not in seen:
                    seen.add(id(main_param))
                    self._by_model[id(model_param)].append((getattr(sub, "optimizer", None), main_param))
                    self._subs[id(model_param)].append(sub)

    def masked(self, model_param: torch.Tensor, mask: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """For each main parameter of ``model_param``: ``(mask restricted to it, [the main parameter and
        the inner optimizer's state tensors of its shape])``, where ``mask`` has the model parameter's
        shape. A distributed-optimizer shard is a range of the flattened parameter
        (``_get_model_param_range_map``); the other classes' main parameters have its full shape."""
        out = []
        entries = zip(self._subs.get(id(model_param), []), self._by_model.get(id(model_param), []))
        for sub, (inner, main) in entries:
            if main.shape == model_param.shape:
                part = mask
            else:
                span = sub._get_model_param_range_map(model_param)["param"]  # type: ignore[attr-defined]
                part = mask.reshape(-1)[span.start : span.end].view(main.shape)
            state = getattr(inner, "state", {}).get(main, {}).values()
            tensors = [main, *(v for v in state if isinstance(v, torch.Tensor) and v.shape == main.shape)]
            out.append((part, tensors))
        return out

    def of(self, model_param: torch.Tensor) -> list[torch.Tensor]:
        return [main for _, main in self._by_model.get(id(model_param), [])]

    def state(self, model_param: torch.Tensor) -> dict:
        """The inner optimizers' state tensors for ``model_param``'s main parameters on this rank."""
        out = {}
        for i, (inner, main) in enumerate(self._by_model.get(id(model_param), [])):
            for key, value in getattr(inner, "state", {}).get(main, {}).items():
                out[f"{i}.{key}"] = value
        return out


class OptimizerStateView:
    """What ``train.dynmo.profile.LayerProfiler`` reads from an optimizer (``.state.get(param, {})``),
    keyed by model parameters although Megatron keeps it under main parameters."""

    def __init__(self, main_params: MainParams) -> None:
        self.state = self
        self._main_params = main_params

    def get(self, model_param: torch.Tensor, default=None) -> dict:
        return self._main_params.state(model_param) or (default if default is not None else {})

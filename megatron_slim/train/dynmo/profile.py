"""Per-layer profiling of a rank's decoder layers during training (``dynmo.profile``).

Forward time: a forward pre-hook and a forward hook on every ``TransformerLayer`` bracket each
call. Backward time: a tensor hook on the layer's output fires when the gradient reaching the layer
is ready (its backward starts), one on its input when the gradient leaving it is complete (its
backward ends); weight-gradient accumulation that autograd runs after that is not counted. On CPU
the stamps are ``time.perf_counter``; on CUDA they are recorded events, resolved after a
synchronise at the end of the iteration. A layer whose input needs no gradient (none here: the
embedding always trains) would report no backward time; forwards without autograd (evaluation)
are not counted.

Activation bytes: while a layer's forward runs, a saved-tensor pack hook counts the storages
autograd saves (once each, parameters left out) and then hands the tensor to whatever pack hook was
active around the layer (the schedule's activation meter or offload), so those keep working.

Memory: parameter bytes, gradient bytes of the trainable ones, and the optimizer's state tensors
for them. Each iteration's totals are divided by the microbatch count, smoothed
(``plan.dynmo.profile.smoothed``), and gathered to every pipeline rank.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_slim.megatron.model.gpt import decoder_layers
from megatron_slim.plan.dynmo.profile import LayerProfile, merged, smoothed


class _Clock:
    """Stamps and their differences: wall-clock on CPU, CUDA events (read after a sync) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, pairs: list) -> float:
        if not self.cuda:
            return sum(b - a for a, b in pairs)
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in pairs) / 1000.0


class LayerProfiler:
    def __init__(self, chunks, optimizer, num_microbatches: int, smoothing: float, pp_group=None) -> None:
        self.layers = decoder_layers(chunks)
        self.optimizer, self.num_microbatches, self.smoothing = optimizer, num_microbatches, smoothing
        self.pp_group = pp_group
        params = [p for chunk in chunks for p in chunk.parameters()]
        self._static = {p.untyped_storage().data_ptr() for p in params}
        self._clock = _Clock(params[0].device if params else torch.device("cpu"))
        self._forward: dict[int, list] = defaultdict(list)
        self._backward: dict[int, list] = defaultdict(list)
        self._saved: dict[int, int] = defaultdict(int)
        self._open: dict[int, Any] = {}  # layer -> (stamp, saved-tensor hooks) of a running forward
        self._backward_start: dict[int, Any] = {}
        self._smoothed: dict[int, LayerProfile] = {}
        self.whole_model: list[LayerProfile] = []  # after ``finish``: every layer, from every pipeline rank
        self._handles = []
        for layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._before_forward, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._after_forward, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before_forward(self, layer, args, kwargs) -> None:
        if not torch.is_grad_enabled():  # evaluation: not training work, not profiled
            return
        index = layer.layer_number - 1
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._backward_end(index))
        hooks = _counting_hooks(self._static, lambda n: self._add_saved(index, n))
        hooks.__enter__()
        self._open[index] = (self._clock.stamp(), hooks)

    def _after_forward(self, layer, args, kwargs, output) -> None:
        index = layer.layer_number - 1
        if index not in self._open:
            return
        started, hooks = self._open.pop(index)
        hooks.__exit__(None, None, None)
        self._forward[index].append((started, self._clock.stamp()))
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._backward_begin(index))

    def _add_saved(self, index: int, nbytes: int) -> None:
        self._saved[index] += nbytes

    def _backward_begin(self, index: int) -> Callable:
        def hook(grad):
            self._backward_start[index] = self._clock.stamp()

        return hook

    def _backward_end(self, index: int) -> Callable:
        def hook(grad):
            started = self._backward_start.pop(index, None)
            if started is not None:
                self._backward[index].append((started, self._clock.stamp()))

        return hook

    def finish(self) -> list[LayerProfile]:
        """Close the iteration: this rank's smoothed profiles, and ``whole_model`` gathered."""
        n = self.num_microbatches
        for layer in self.layers:
            i = layer.layer_number - 1
            newest = LayerProfile(
                i,
                self._clock.seconds(self._forward.pop(i, [])) / n,
                self._clock.seconds(self._backward.pop(i, [])) / n,
                *_static_bytes(layer, self.optimizer),
                self._saved.pop(i, 0) / n,
            )
            self._smoothed[i] = smoothed(self._smoothed.get(i), newest, self.smoothing)
        mine = [self._smoothed[layer.layer_number - 1] for layer in self.layers]
        self.whole_model = merged(_gathered(mine, self.pp_group))
        return mine


def _static_bytes(layer, optimizer) -> tuple[int, int, int]:
    params = list(layer.parameters())
    nbytes = [p.numel() * p.element_size() for p in params]
    # Megatron's DDP keeps a frozen parameter's slot in its gradient buffer (``main_grad``) allocated
    grads = sum(_gradient_bytes(p, b) for p, b in zip(params, nbytes))
    state = 0
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                state += value.numel() * value.element_size()
    return sum(nbytes), grads, state


def _gradient_bytes(param: torch.Tensor, nbytes: int) -> int:
    main_grad = getattr(param, "main_grad", None)
    if isinstance(main_grad, torch.Tensor):
        return main_grad.numel() * main_grad.element_size()
    return nbytes if param.requires_grad else 0


def _counting_hooks(static: set, count: Callable[[int], None]):
    """Saved-tensor hooks that count new storages, then defer to the hooks active outside."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in static and ptr not in seen:
            seen.add(ptr)
            count(storage.nbytes())
        return outer[0](t) if outer else t

    def unpack(packed):
        return outer[1](packed) if outer else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _gathered(mine: list[LayerProfile], group) -> list[list[LayerProfile]]:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    out: list[Optional[list[LayerProfile]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return [rank or [] for rank in out]

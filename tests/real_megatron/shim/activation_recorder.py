"""Peak activation bytes per rank and iteration, measured the same way under any schedule
(benchmark / test harness only; ``MEGATRON_SLIM_BENCH_ACTIVATIONS=1`` with
``MEGATRON_SLIM_TEST_RECORD=DIR``).

What is counted, precisely
--------------------------
One process-wide ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor autograd saves
for backward, whichever code saves it: Megatron's own layers and schedules, megatron-slim's slice
attention, custom ``autograd.Function``\\ s (``ctx.save_for_backward``) alike. For each saved tensor
the pack hook takes its *storage* (a view keeps its whole storage alive, so a storage is what
memory holds) and:

* skips it if it is a storage of a model parameter (the storages of every parameter of every model
  chunk, collected when ``train()`` starts, plus any ``torch.nn.Parameter`` or view of one noticed
  on the fly): weights saved by matmuls are static memory, not activations. A stage's received
  input is a leaf that requires grad too, but it is an activation and is counted;
* otherwise counts ``storage.nbytes()`` once per storage, however many saved-tensor slots refer to
  it, from the moment autograd first saves a tensor on it until the last slot referring to it is
  released (autograd drops a node's saved tensors when its backward has run, or when the graph is
  freed unused). The pack hook hands autograd a small holder with a storage-sharing alias of the
  tensor; the holder's finaliser is the release. So *live saved bytes* is, at every instant, the
  bytes of distinct non-parameter storages that some autograd graph holds for backward, and its
  maximum over an iteration is the iteration's peak.

Included therefore: every layer's saved inputs and intermediates, the received stage input
(saved by the first norm), Megatron's attention score/probability matrices ``[b*np, sq, sk]`` of
its local (unfused) ``DotProductAttention``, the logits saved by the loss, and megatron-slim's
K/V cache: each slice's K and V chunks are the very storages slice attention saves for its
backward (the cache keeps a detached alias of the same storage), so the cache is counted here, as
real activation memory, while any graph still holds it.
Not included: tensors nobody saves for backward (a stage's output once sent, Megatron's
pseudo-freed outputs, p2p receive buffers until a layer saves them, transient workspaces such as
an attention kernel's scratch), megatron-slim's fp32 dK/dV accumulation buffers (they live only
during a microbatch's backward and are not saved tensors), gradients, optimizer state, and
allocator overhead. Storages shaped like square attention matrices (last two dims both equal to
``--seq-length``) are additionally tallied apart (``peak_sxs_bytes``, and ``peak_excl_sxs_bytes``
is the peak of live saved bytes without them), because on a CPU Megatron's local attention
materialises them while megatron-slim's kernels (like flash attention on a GPU) do not: the split
separates the schedule's effect from the attention implementation's.

Each rank writes, per training iteration, ``{"kind": "activations", "iteration", "peak_bytes",
"peak_excl_sxs_bytes", "peak_sxs_bytes", "live_bytes_after", "saved_tensors"}`` to its record
JSONL, ``live_bytes_after`` being what graphs still hold when Megatron logs the iteration (0
when every graph was consumed). The hooks are entered on the thread that calls ``train()`` (the
main thread, which runs every forward) and left when it returns.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
from typing import Iterable, Optional

import torch


class _Saved:
    """What autograd keeps for one saved tensor: a storage-sharing alias and the storage's key."""

    __slots__ = ("tensor", "key", "counter", "__weakref__")

    def __init__(self, tensor, key, counter):
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self):
        self.counter._release(self.key)


class SavedActivationCounter:
    """Live and peak bytes of the distinct non-parameter storages autograd holds for backward.

    ``square`` (optional): a storage whose saved tensor has its last two dims both equal to it is
    also tallied as a square attention matrix.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = (), square: Optional[int] = None) -> None:
        self._static: set[int] = set()
        self.add_parameters(parameters)
        self.square = square
        self._refs: dict[int, list] = {}  # storage key -> [slots, nbytes, is_square]
        self.live_bytes = 0
        self.live_sxs_bytes = 0
        self.peak_bytes = 0
        self.peak_excl_sxs_bytes = 0
        self.peak_sxs_bytes = 0
        self.saved_tensors = 0
        self._hooks = None
        self._thread = None

    def add_parameters(self, parameters: Iterable[torch.Tensor]) -> None:
        for p in parameters:
            self._static.add(p.untyped_storage().data_ptr())

    # ---- the hooks ---------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        self.saved_tensors += 1
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._static:
            return t
        base = t if t._base is None else t._base
        if isinstance(base, torch.nn.Parameter):  # a parameter (or a view of one) not seen yet
            self._static.add(key)
            return t
        nbytes = storage.nbytes()
        if key == 0 or nbytes == 0:
            return t
        entry = self._refs.get(key)
        if entry is not None:
            entry[0] += 1
        else:
            square = self.square is not None and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == self.square
            self._refs[key] = [1, nbytes, square]
            self.live_bytes += nbytes
            if square:
                self.live_sxs_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_excl_sxs_bytes = max(self.peak_excl_sxs_bytes, self.live_bytes - self.live_sxs_bytes)
            self.peak_sxs_bytes = max(self.peak_sxs_bytes, self.live_sxs_bytes)
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if type(packed) is _Saved else packed

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live_bytes -= entry[1]
            if entry[2]:
                self.live_sxs_bytes -= entry[1]

    # ---- control -----------------------------------------------------------------------------
    def enter(self) -> None:
        """Push the hooks on the calling thread (autograd's saved-tensor hooks are thread-local)."""
        if self._hooks is not None:
            raise RuntimeError("SavedActivationCounter: hooks already entered")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._thread = threading.current_thread()

    def exit(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def __enter__(self):
        self.enter()
        return self

    def __exit__(self, *exc):
        self.exit()

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_sxs_bytes = self.live_sxs_bytes
        self.peak_excl_sxs_bytes = self.live_bytes - self.live_sxs_bytes
        self.saved_tensors = 0


def _write(record: dict) -> None:
    path = os.path.join(os.environ["MEGATRON_SLIM_TEST_RECORD"], f"rank{os.environ.get('RANK', '0')}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def install(training) -> None:
    """Wrap ``train`` (collect the model's parameter storages, enter the hooks on the calling
    thread) and ``training_log`` (write the iteration's peak, start the next one) in
    ``megatron.training.training``."""
    train = training.train
    training_log = training.training_log
    signature = inspect.signature(training_log)
    state: dict = {}

    @functools.wraps(train)
    def measuring_train(forward_step_func, model, *args, **kwargs):
        chunks = model if isinstance(model, (list, tuple)) else [model]
        seq_length = getattr(training.get_args(), "seq_length", None)
        counter = SavedActivationCounter((p for m in chunks for p in m.parameters()), square=seq_length)
        state["counter"] = counter
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "activation_recorder: train() runs off the main thread; the hooks would not see the forward"
            )
        counter.enter()
        try:
            return train(forward_step_func, model, *args, **kwargs)
        finally:
            counter.exit()

    @functools.wraps(training_log)
    def measuring_training_log(*args, **kwargs):
        counter: SavedActivationCounter = state.get("counter")
        if counter is not None:
            iteration = signature.bind(*args, **kwargs).arguments["iteration"]
            _write(
                {
                    "kind": "activations",
                    "iteration": int(iteration),
                    "peak_bytes": counter.peak_bytes,
                    "peak_excl_sxs_bytes": counter.peak_excl_sxs_bytes,
                    "peak_sxs_bytes": counter.peak_sxs_bytes,
                    "live_bytes_after": counter.live_bytes,
                    "saved_tensors": counter.saved_tensors,
                    "thread": counter._thread.name if counter._thread else None,
                }
            )
            if counter.saved_tensors == 0:
                raise RuntimeError(
                    "activation_recorder: no tensor was saved for backward this iteration; another "
                    "saved_tensors_hooks context shadows the recorder's"
                )
        result = training_log(*args, **kwargs)
        if counter is not None:
            counter.reset_peak()
        return result

    training.train = measuring_train
    training.training_log = measuring_training_log

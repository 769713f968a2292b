"""Test harness only: run Megatron-LM's own CUDA-only training loop on CPU gloo ranks.

Megatron's start-up and loop assume CUDA (``assert torch.cuda.is_available()``, ``device="cuda"``,
``.cuda()``, ``torch.cuda.synchronize()``, CUDA RNG states). This shim answers those as one fake
device whose tensors live on the CPU, so the *unmodified* ``pretrain()`` of each Megatron-LM tag
trains on gloo and its losses can be compared with megatron-slim's. megatron-slim's own code is not
shimmed: it decides devices from the tensors it is given, and those are CPU tensors.

Installed by ``sitecustomize.py`` beside this file when ``MEGATRON_SLIM_TEST_CPU_SHIM=1``.
"""

from __future__ import annotations

import os
import time
import types

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


def _to_cpu(device):
    return _CPU if _is_cuda(device) else device


class _CudaDevicesOnCpu(TorchFunctionMode):
    """Every ``device=`` naming CUDA (``"cuda"``, ``"cuda:3"``, ``torch.device("cuda")``, an
    ordinal) becomes the CPU; ``Tensor.to(<cuda>)`` likewise; ``Tensor.type()`` names the fake
    device's tensor types (``torch.cuda.FloatTensor``), which Megatron's optimizers check for."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            result = result.replace("torch.", "torch.cuda.", 1) if ".cuda." not in result else result
        return result


def _identity(self, *args, **kwargs):
    return self


class _FakeEvent:
    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, *args, **kwargs):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * (end._t - self._t)


class _FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def is_capturing(self):
        return False

    def synchronize(self):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        event = event or _FakeEvent()
        event.record()
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _StreamContext:
    def __init__(self, stream=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _local_device_count() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    properties = types.SimpleNamespace(
        name="megatron-slim CPU shim", total_memory=80 * 2**30, major=9, minor=0, multi_processor_count=132
    )
    fakes = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": _local_device_count,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "reset_max_memory_allocated": lambda device=None: None,
        "memory_stats": lambda device=None: {},
        "mem_get_info": lambda device=None: (properties.total_memory, properties.total_memory),
        "get_device_properties": lambda device=None: properties,
        "get_device_capability": lambda device=None: (properties.major, properties.minor),
        "get_device_name": lambda device=None: properties.name,
        # The "device" RNG is the CPU generator: tensors that Megatron thinks are on the GPU are
        # CPU tensors, so its RNG tracker's forks must swap the generator they actually draw from.
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "Event": _FakeEvent,
        "Stream": _FakeStream,
        "current_stream": lambda device=None: _FakeStream(),
        "default_stream": lambda device=None: _FakeStream(),
        "stream": _StreamContext,
        "set_stream": lambda stream: None,
    }
    for name, fake in fakes.items():
        setattr(cuda, name, fake)
    cuda.random.get_rng_state = fakes["get_rng_state"]
    cuda.random.set_rng_state = fakes["set_rng_state"]
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    # torch's own optimizers ask the accelerator API whether a CUDA graph is being captured; a CUDA
    # build of torch without a driver would raise there.
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        accelerator.current_stream = lambda device=None: _FakeStream()
        accelerator.current_device_index = lambda: 0
        accelerator.synchronize = lambda device=None: None
    torch.Tensor.cuda = _identity
    torch.Tensor.pin_memory = _identity
    torch.nn.Module.cuda = _identity


def patch_megatron_rng(random_module) -> None:
    """``megatron.core.tensor_parallel.random._set_cuda_rng_state`` goes through CUDA generators."""
    random_module._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    random_module._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()


def patch_fused_kernels(fused_kernels) -> None:
    """``megatron.legacy.fused_kernels.load`` compiles CUDA extensions with nvcc."""
    fused_kernels.load = lambda args: None


def patch_dataset_helpers(utils) -> None:
    """``compile_helpers`` runs ``make`` in ``megatron/core/datasets``, which a megatron-core wheel
    ships already compiled (``helpers_cpp``) and without its Makefile; a Megatron-LM checkout (what
    users run) has both."""
    import importlib

    importlib.import_module("megatron.core.datasets.helpers_cpp")
    utils.compile_helpers = lambda: None


def patch_torch_norm(torch_norm) -> None:
    """With neither apex nor Transformer Engine, megatron-core's local spec normalises with
    ``WrappedTorchNorm``, which refuses sequence parallelism only because plain torch norms do not
    tag their weights: the fused CUDA norms tag them ``sequence_parallel`` so that
    ``finalize_model_grads`` all-reduces their gradients over the TP group. Do what they do."""
    import copy

    original = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


_mode = None


def install() -> None:
    global _mode
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Megatron's jit fusers are torch.compile, which would compile for the fake CUDA device: run eagerly.
    import torch._dynamo

    torch._dynamo.config.disable = True
    _patch_torch_cuda()
    _mode = _CudaDevicesOnCpu()
    _mode.__enter__()

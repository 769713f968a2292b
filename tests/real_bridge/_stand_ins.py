"""Stand-in modules for GPU-only packages Megatron-Bridge imports at module level, for a test
process on a machine without them (see conftest.py). Only packages that are not installed are
stood in for."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

GPU_ONLY = (
    "transformer_engine",
    "transformer_engine_torch",
    "modelopt",
    "nvidia_resiliency_ext",
    "flash_attn",
    "mamba_ssm",
    "causal_conv1d",
    "fla",
    "flashinfer",
    "fast_hadamard_transform",
    "open_clip",
    "timm",
    "qwen_vl_utils",
    "mlflow",
    "comet_ml",
    "wandb",
    "datasets",
    "accelerate",
    "peft",
    "diffusers",
    "mistral_common",
    "nv_one_logger",
    "onelogger",
)


class _StandInType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in_class(name)


def _stand_in_class(name):
    return _StandInType(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})


class _StandInModule(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stand_in_class(name)
        setattr(self, name, value)
        return value


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, missing):
        self.missing = set(missing)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.missing:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__version__ = "0.0"
        return module

    def exec_module(self, module):
        pass


# data and inference code: not on the paths under test, and some of it rewrites sys.path on import
SKIPPED_CORE_PACKAGES = ("megatron.core.datasets", "megatron.core.inference", "megatron.core.export")


def _import_all(package) -> None:
    import pkgutil

    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name.startswith(SKIPPED_CORE_PACKAGES):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional extra's module: not what the tests use
            continue
        if info.ispkg:
            _import_all(module)


def _import_megatron_core() -> None:
    """megatron-core probes for Transformer Engine when each of its modules is imported
    (``HAVE_TE``); importing them all before the stand-ins exist keeps megatron-core on its
    non-TE paths, as on a machine without TE."""
    import warnings

    import megatron.core

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _import_all(megatron.core)


def install() -> list[str]:
    """Stand in for every GPU-only package that is not installed; returns their names."""
    if any(isinstance(finder, _StandIns) for finder in sys.meta_path):
        return []
    missing = [name for name in GPU_ONLY if importlib.util.find_spec(name) is None]
    if missing:
        _import_megatron_core()
        sys.meta_path.insert(0, _StandIns(missing))
    return missing

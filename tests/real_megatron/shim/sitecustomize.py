"""Test harness only (put this folder on PYTHONPATH): with ``MEGATRON_SLIM_TEST_CPU_SHIM=1`` Megatron's
CUDA plumbing runs on the CPU (``megatron_cpu_shim``); with ``MEGATRON_SLIM_TEST_RECORD=DIR`` every
rank writes the exact per-iteration lm loss, grad norm and evaluation losses Megatron computed to
``DIR/rank<R>.jsonl`` (``metrics_recorder``), instead of the rounded figures it prints; with
``MEGATRON_SLIM_BENCH_ACTIVATIONS=1`` as well, each rank also records the peak bytes autograd held
saved for backward per iteration, the same way under any schedule (``activation_recorder``); with
``MEGATRON_SLIM_TEST_LAYER_WEIGHTS=1``, a digest of each decoder layer's weights after every
training step (``weights_recorder``); with ``MEGATRON_SLIM_TEST_INIT_BY_NAME=1``, initial weights that
depend on each parameter's global name only, so different pipeline splits start alike
(``init_by_name``); with ``MEGATRON_SLIM_NCCL_RULES=1``, gloo matches messages and collectives as
NCCL would, Megatron's own included (``megatron_slim.runtime.nccl_rules``)."""

import os
import sys

_installed: set[str] = set()


def _once(part: str) -> bool:
    """True the first time ``part`` is asked for (a process installs each part once)."""
    if part in _installed:
        return False
    _installed.add(part)
    return True


def install() -> None:
    """Install what this process's environment asks for and is not installed yet (at interpreter
    start-up; ``forkrun.py``'s launch server calls it again in each launch's process, whose
    environment may ask for more)."""
    cpu_shim = os.environ.get("MEGATRON_SLIM_TEST_CPU_SHIM") == "1"
    record = bool(os.environ.get("MEGATRON_SLIM_TEST_RECORD"))
    if os.environ.get("MEGATRON_SLIM_NCCL_RULES") == "1" and _once("nccl_rules"):
        from megatron_slim.runtime.nccl_rules import install as install_nccl_rules

        install_nccl_rules()
    if not (cpu_shim or record):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import post_import

    if cpu_shim and _once("cpu"):
        import megatron_cpu_shim

        megatron_cpu_shim.install()
        post_import.when_imported("megatron.core.tensor_parallel.random", megatron_cpu_shim.patch_megatron_rng)
        post_import.when_imported("megatron.legacy.fused_kernels", megatron_cpu_shim.patch_fused_kernels)
        post_import.when_imported("megatron.core.datasets.utils", megatron_cpu_shim.patch_dataset_helpers)
        post_import.when_imported("megatron.core.transformer.torch_norm", megatron_cpu_shim.patch_torch_norm)
    if cpu_shim and os.environ.get("MEGATRON_SLIM_TEST_INIT_BY_NAME") == "1" and _once("init_by_name"):
        import init_by_name

        post_import.when_imported("megatron.training.training", init_by_name.install)
        post_import.when_imported("megatron.training.models.gpt", init_by_name.install_builder)
    if record and _once("record"):
        import metrics_recorder

        post_import.when_imported("megatron.training.training", metrics_recorder.install)
    if record and os.environ.get("MEGATRON_SLIM_TEST_LAYER_WEIGHTS") == "1" and _once("layer_weights"):
        import weights_recorder

        post_import.when_imported("megatron.training.training", weights_recorder.install)
    if record and os.environ.get("MEGATRON_SLIM_BENCH_ACTIVATIONS") == "1" and _once("activations"):
        import activation_recorder

        post_import.when_imported("megatron.training.training", activation_recorder.install)


install()

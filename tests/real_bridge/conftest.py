"""The real megatron-bridge package, where it is installed (``README.md`` beside this file).

``import megatron.bridge`` pulls in GPU-only packages at module level (Transformer Engine from
``peft/lora_layers.py``, ModelOpt from ``training/gpt_step.py``, nvidia-resiliency-ext, ...). Where
one of them is not installed (a CPU machine), this conftest puts a stand-in module in its place
for the test process only, so that Bridge's own ``train``, ``eval``, ``gpt_step``, ``losses`` and
``gpt_provider`` modules load and run; nothing in the code paths under test calls into them.
"""

import importlib.util

import pytest


def bridge_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        return False


if bridge_installed():
    from tests.real_bridge import _stand_ins

    _stand_ins.install()


def pytest_collection_modifyitems(config, items):
    if bridge_installed():
        return
    skip = pytest.mark.skip(reason="megatron-bridge is not installed (tests/real_bridge/README.md says how)")
    for item in items:
        if "real_bridge" in str(item.fspath):
            item.add_marker(skip)

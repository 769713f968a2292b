import subprocess
import sys


def test_planning_core_imports_no_torch():
    code = (
        "import pkgutil, importlib, sys, megatron_slim.plan as p\n"
        "for m in pkgutil.walk_packages(p.__path__, 'megatron_slim.plan.'):\n"
        "    importlib.import_module(m.name)\n"
        "import megatron_slim.commands.simulate, megatron_slim.commands.overlay, megatron_slim.train.checks\n"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_data_layer_imports_neither_torch_nor_megatron():
    code = (
        "import pkgutil, importlib, sys, megatron_slim.data as d\n"
        "for m in pkgutil.walk_packages(d.__path__, 'megatron_slim.data.'):\n"
        "    importlib.import_module(m.name)\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "assert not loaded, loaded[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""``python -m megatron_slim.launch`` with megatron-slim flags on a script that never parses
Megatron-LM's arguments, as a Megatron-Bridge recipe does (its ``pretrain`` reads a
ConfigContainer): the launcher stops with one line naming the flags and the Bridge entry point,
at the first layer spec the script builds, instead of training without SlimPipe."""

import os
import subprocess
import sys

import pytest

from tests.real_megatron.harness import REPO, installed_tag

pytestmark = pytest.mark.real_megatron

SCRIPT = """\
from megatron.core.models.gpt import gpt_layer_specs
spec = gpt_layer_specs.get_gpt_layer_local_spec()
print("built", spec.submodules.self_attention.submodules.core_attention.__name__)
"""


def _launch(tmp_path, *flags):
    script = tmp_path / "bridge_like_recipe.py"
    script.write_text(SCRIPT)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(installed_tag()), str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-m", "megatron_slim.launch", str(script), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.smoke  # a start-up refusal; the unchanged run is in `make test-megatron`
def test_our_flags_on_a_script_that_parses_no_megatron_args_stop_the_launch(tmp_path):
    out = _launch(tmp_path, "--use-slimpipe", "--slimpipe-num-slices", "4")
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_slim.launch: error: --use-slimpipe, --slimpipe-num-slices: ")
    assert "megatron_slim.megatron.bridge.install(config" in last
    assert "built" not in out.stdout


def test_without_our_flags_the_same_script_runs_unchanged(tmp_path):
    out = _launch(tmp_path, "--seq-length", "64")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "built DotProductAttention" in out.stdout

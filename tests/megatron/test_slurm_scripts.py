"""scripts/slurm: the dry run prints, per node, the torchrun command that launches pretrain_gpt.py
through megatron_slim.launch with the recipe's flags."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slim.megatron.flags import recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "pretrain_gpt.sbatch"


def _dry_run(**env):
    full = dict(os.environ, DRY_RUN="1", MEGATRON_SLIM=f"{sys.executable} -m megatron_slim.cli",
                MEGATRON_LM="/opt/Megatron-LM", **env)
    full.pop("SLURM_NNODES", None)
    full.pop("SLURM_JOB_NODELIST", None)
    full.update(env)
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True)


@pytest.mark.parametrize("recipe,nodes", [("llama2-7b-64k", 8), ("llama2-70b-512k", 32)])
def test_dry_run_prints_one_launch_per_node_with_the_recipe_flags(recipe, nodes):
    run = _dry_run(RECIPE=recipe, DATA_PATH="/data/corpus_text_document", MASTER_PORT="6123")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == nodes
    expected_flags = recipe_to_megatron_args(load_recipe(recipe))
    for i, line in enumerate(lines):
        prefix, command = line.split(": ", 1)
        assert prefix == f"node {i} (node{i})"
        words = shlex.split(command)
        assert words[words.index("--nnodes") + 1] == str(nodes)
        assert words[words.index("--nproc_per_node") + 1] == "8"
        assert words[words.index("--rdzv_endpoint") + 1] == "node0:6123"
        start = words.index("megatron_slim.launch")
        assert words[start - 1] == "-m" and words[start + 1] == "/opt/Megatron-LM/pretrain_gpt.py"
        rest = words[start + 2:]
        assert rest[:len(expected_flags)] == expected_flags
        assert ["--data-path", "/data/corpus_text_document"] == rest[len(expected_flags):len(expected_flags) + 2]
        assert "--save" in rest and "--load" in rest
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in words


def test_recipe_overrides_and_a_mismatched_allocation():
    run = _dry_run(RECIPE="llama2-7b-64k", RECIPE_SET="parallel.dp=2 train.global_batch_size=32")
    assert run.returncode == 0 and len(run.stdout.strip().splitlines()) == 4
    assert "--mock-data" in run.stdout
    bad = _dry_run(RECIPE="llama2-7b-64k", SLURM_NNODES="3")
    assert bad.returncode == 2 and "needs 8 nodes" in bad.stderr
    unknown = _dry_run(RECIPE="nope")
    assert unknown.returncode != 0 and "unknown recipe 'nope'" in unknown.stderr

"""scripts/slurm: the dry run prints, once, the torchrun command every node runs to launch
pretrain_gpt.py through megatron_slim.launch with the recipe's flags, and the nodes it runs on."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from tests.slurm_standins import write_standins

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "pretrain_gpt.sbatch"


def _dry_run(**env):
    full = dict(
        os.environ,
        DRY_RUN="1",
        MEGATRON_SLIM=f"{sys.executable} -m megatron_slim.cli",
        MEGATRON_LM="/opt/Megatron-LM",
        **env,
    )
    full.pop("SLURM_NNODES", None)
    full.pop("SLURM_JOB_NODELIST", None)
    full.update(env)
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True)


@pytest.mark.parametrize("recipe,nodes", [("llama2-7b-64k", 8), ("llama2-70b-512k", 32)])
def test_dry_run_prints_the_launch_every_node_runs_once_with_the_recipe_flags(recipe, nodes):
    run = _dry_run(RECIPE=recipe, DATA_PATH="/data/corpus_text_document", MASTER_PORT="6123")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1
    expected_flags = recipe_to_megatron_args(load_recipe(recipe))
    for line in lines:
        prefix, command = line.split(": ", 1)
        assert prefix == f"on each of {nodes} node(s) ({' '.join(f'node{i}' for i in range(nodes))})"
        words = shlex.split(command)
        assert words[words.index("--nnodes") + 1] == str(nodes)
        assert words[words.index("--nproc_per_node") + 1] == "8"
        assert words[words.index("--rdzv_endpoint") + 1] == "node0:6123"
        start = words.index("megatron_slim.launch")
        assert words[start - 1] == "-m" and words[start + 1] == "/opt/Megatron-LM/pretrain_gpt.py"
        rest = words[start + 2 :]
        assert rest[: len(expected_flags)] == expected_flags
        assert rest[len(expected_flags) : len(expected_flags) + 2] == ["--data-path", "/data/corpus_text_document"]
        assert "--save" in rest and "--load" in rest
        assert rest[rest.index("--tensorboard-dir") + 1] == f"{rest[rest.index('--save') + 1]}/tensorboard"
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in words


def test_recipe_overrides_and_a_mismatched_allocation():
    run = _dry_run(RECIPE="llama2-7b-64k", RECIPE_SET="parallel.dp=2 train.global_batch_size=32")
    assert run.returncode == 0 and run.stdout.startswith("on each of 4 node(s) ")
    assert "--mock-data" in run.stdout
    assert run.stderr.count("changes the job from") == 1  # the recipe note once, not once per query
    bad = _dry_run(RECIPE="llama2-7b-64k", SLURM_NNODES="3")
    assert bad.returncode == 2 and "needs 8 nodes" in bad.stderr
    unknown = _dry_run(RECIPE="nope")
    assert unknown.returncode != 0 and "unknown recipe 'nope'" in unknown.stderr
    refused = _dry_run(RECIPE="tiny-cpu", RECIPE_SET="train.iters=4")  # warmup 4: megatron-args refuses it
    assert refused.returncode != 0 and refused.stdout == "" and "train.warmup_iters" in refused.stderr


REPO = SCRIPT.parents[2]


@pytest.fixture
def slurm_path(tmp_path):
    """A PATH with an ``sbatch`` that dry-runs the batch script and this checkout's ``megatron-slim``."""
    return f"{write_standins(tmp_path / 'bin', dry_run=True)}{os.pathsep}{os.environ['PATH']}"


def _clean_env(path, **env):
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RECIPE", "RECIPE_SET", "DRY_RUN", "MEGATRON_SLIM") and not k.startswith("SLURM_")
    }
    full.update(PATH=path, MEGATRON_LM="/opt/Megatron-LM", **env)
    return full


def test_without_recipe_the_batch_script_refuses_to_run(slurm_path):
    from megatron_slim.plan.recipe import available_recipes

    for env in ({}, {"RECIPE": ""}):
        run = subprocess.run(
            ["bash", str(SCRIPT)], env=_clean_env(slurm_path, DRY_RUN="1", **env), capture_output=True, text=True
        )
        assert run.returncode == 2 and run.stdout == ""
        assert "RECIPE: not set" in run.stderr
        assert all(name in run.stderr for name in available_recipes())


def test_submit_sh_counts_nodes_with_the_recipe_overrides(slurm_path):
    run = subprocess.run(
        ["bash", str(SCRIPT.parent / "submit.sh"), "llama2-7b-64k"],
        capture_output=True,
        text=True,
        env=_clean_env(slurm_path, RECIPE_SET="parallel.dp=2 train.global_batch_size=32"),
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("on each of 4 node(s) ")


def _readme_slurm_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("### On a cluster with Megatron-LM", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    return [
        ln.split("  #", 1)[0].strip() for b in blocks for ln in b.splitlines() if "sbatch" in ln or "submit.sh" in ln
    ]


def test_readme_slurm_commands_run_as_written(slurm_path):
    lines = _readme_slurm_lines()
    assert any(ln.startswith("scripts/slurm/submit.sh") for ln in lines)
    assert any(" sbatch " in f" {ln} " for ln in lines) and any(ln.startswith("DRY_RUN=1") for ln in lines)
    for line in lines:
        run = subprocess.run(["bash", "-c", line], cwd=REPO, env=_clean_env(slurm_path), capture_output=True, text=True)
        assert run.returncode == 0, f"README command failed: {line}\n{run.stderr}"
        recipe = shlex.split(line.replace("$(", " ").replace(")", " "))
        name = (
            next(w.split("=", 1)[1] for w in recipe if w.startswith("RECIPE="))
            if "RECIPE=" in line
            else recipe[recipe.index("scripts/slurm/submit.sh") + 1]
        )
        flags = recipe_to_megatron_args(load_recipe(name))
        launches = run.stdout.strip().splitlines()
        assert len(launches) == 1 and shlex.join(flags) in launches[0], line


def test_extra_args_keep_quoted_values_with_spaces_whole():
    run = _dry_run(
        RECIPE="llama2-7b-64k",
        EXTRA_ARGS='--wandb-exp-name "my long run" --exit-interval 5',
        TOKENIZER_ARGS="--tokenizer-type HuggingFaceTokenizer --tokenizer-model '/data/tok dir'",
    )
    assert run.returncode == 0, run.stderr
    first = run.stdout.splitlines()[0]
    assert r"--wandb-exp-name my\ long\ run --exit-interval 5" in first
    assert r"--tokenizer-model /data/tok\ dir" in first
    bad = _dry_run(RECIPE="llama2-7b-64k", EXTRA_ARGS='--wandb-exp-name "unbalanced')
    assert bad.returncode == 2 and "EXTRA_ARGS: not valid shell words" in bad.stderr


def test_a_data_blend_reaches_megatron_as_words():
    """DATA_PATH is word-split as Megatron-LM's own examples do, so a blend is weights and prefixes;
    shell quoting keeps a path with a space one word."""
    run = _dry_run(RECIPE="llama2-7b-64k", DATA_PATH="0.3 /data/a_text_document 0.7 '/data/b c_text_document'")
    assert run.returncode == 0, run.stderr
    words = shlex.split(run.stdout.split(": ", 1)[1])
    at = words.index("--data-path")
    assert words[at : at + 6] == [
        "--data-path",
        "0.3",
        "/data/a_text_document",
        "0.7",
        "/data/b c_text_document",
        "--split",
    ]
    bad = _dry_run(RECIPE="llama2-7b-64k", DATA_PATH="0.3 '/data/a")
    assert bad.returncode == 2 and "DATA_PATH: not valid shell words" in bad.stderr

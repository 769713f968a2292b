"""The README's numbered path, followed as written on CPU ranks: a recipe (``tiny-cpu``, made tiny
with ``RECIPE_SET``), ``scripts/slurm/submit.sh`` (SLURM's ``sbatch`` and ``srun`` replaced by
stand-ins that run here), torchrun with ``-m megatron_slim.launch`` and Megatron-LM core_v0.16.1's
own ``pretrain_gpt.py``. The job saves every 2 iterations, stops at iteration 4 (Megatron's
``--exit-interval``), and the same submission resumes it: iterations 5 and 6 then train exactly as
in a run that was never interrupted. Only SLURM and the CPU flags (gloo, no fused CUDA kernels) are
the test's; the commands, flags and scripts are the user's."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_megatron.harness import CPU_FLAGS, REPO, SHIM, TINY, _read_records, installed_tag, write_corpus
from tests.slurm_standins import write_standins

pytestmark = pytest.mark.real_megatron

# the harness's tiny Llama (RoPE, RMSNorm, SwiGLU, GQA) at pp2 with SlimPipe's 4 slices, 6 iterations
RECIPE_SET = [s for s in TINY if not s.startswith(("parallel.pp=", "train.iters="))] + [
    "parallel.pp=2",
    "train.iters=6",
    "train.save_interval=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A PATH with the stand-ins and a ``megatron-slim`` that runs this checkout's CLI."""
    bin_dir = write_standins(tmp_path_factory.mktemp("slurm-bin"), dry_run=False, srun=True)
    (bin_dir / "python").symlink_to(sys.executable)  # the batch script's default PYTHON, and torchrun's
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n')
    torchrun.chmod(0o755)
    return bin_dir


def _submit(
    slurm: Path, corpus: Path, ckpt: Path, records: Path, extra: list[str]
) -> tuple[subprocess.CompletedProcess, list]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))}
    env.update(
        PATH=f"{slurm}{os.pathsep}{env['PATH']}",
        RECIPE_SET=" ".join(RECIPE_SET),
        MEGATRON_LM=str(installed_tag()),
        DATA_PATH=str(corpus),
        CKPT_DIR=str(ckpt),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        # what a CPU run needs (the contract tier's CPU_FLAGS; the batch script sets --split itself)
        EXTRA_ARGS=shlex.join([f for f in CPU_FLAGS if f not in ("--split", "90,5,5")] + extra),
        # the test harness: Megatron's CUDA plumbing answered on the CPU, and the exact losses recorded
        PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO)]),
        MEGATRON_SLIM_TEST_CPU_SHIM="1",
        MEGATRON_SLIM_TEST_RECORD=str(records),
        OMP_NUM_THREADS="1",
    )
    records.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm" / "submit.sh"), "tiny-cpu"],
        env=env,
        cwd=ckpt.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done, _read_records(records, 2)


@pytest.mark.skipif(
    installed_tag().name != "core_v0.16.1", reason="the README path runs on core_v0.16.1 (make test-megatron)"
)
def test_the_readme_path_saves_at_its_interval_and_resumes_as_if_never_stopped(tmp_path, slurm):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus" / "docs")
    stopped, first = _submit(slurm, corpus, tmp_path / "ckpt", tmp_path / "records-1", ["--exit-interval", "4"])
    assert "megatron-slim: SlimPipe schedule" in stopped.stdout + stopped.stderr
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*"))
    assert saved == ["iter_0000002", "iter_0000004"] and len(first.losses) == 4
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    resumed_job, resumed = _submit(slurm, corpus, tmp_path / "ckpt", tmp_path / "records-2", [])
    log = resumed_job.stdout + resumed_job.stderr
    assert "at iteration 4" in log  # Megatron: "loading distributed checkpoint from ... at iteration 4"
    whole_job, whole = _submit(slurm, corpus, tmp_path / "whole", tmp_path / "records-3", [])
    assert len(whole.losses) == 6 and whole.losses[:4] == first.losses
    assert (resumed.losses, resumed.grad_norms) == (whole.losses[4:], whole.grad_norms[4:])
    assert (tmp_path / "ckpt" / "tensorboard").is_dir()  # the batch script's TensorBoard folder

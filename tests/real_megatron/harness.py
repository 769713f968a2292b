"""Run Megatron-LM's own ``pretrain_gpt.py`` on CPU gloo ranks, with and without megatron-slim.

The Megatron-LM files are the release tags in ``../shared/megatron-lm/`` (beside the repository;
``MEGATRON_LM_TAGS`` overrides), never copies. The tag is the one that pairs with the installed
megatron-core (0.16.1 on Python 3.11, 0.19.x on Python 3.12; see ``make test-megatron-py312``).
Each run is ``torchrun --standalone ... [-m megatron_slim.launch] <tag>/pretrain_gpt.py <flags>``
(or the same ranks forked from a launch server that imported torch and Megatron-LM once:
``forkrun.py``, the default; ``MEGATRON_SLIM_TEST_LAUNCH=torchrun`` runs every case under torchrun)
with ``shim/`` on ``PYTHONPATH``: its ``sitecustomize`` answers Megatron's CUDA plumbing on the CPU
and records the exact per-iteration ``lm loss``, ``grad norm`` and evaluation losses each rank
computed (and, with ``MEGATRON_SLIM_BENCH_ACTIVATIONS=1`` in ``env``, the peak bytes autograd
holds saved for backward per iteration: ``shim/activation_recorder.py``; ``benchmarks/real_loop.py``
uses it). megatron-slim's code is not shimmed.

Model flags come from ``megatron-slim megatron-args`` of a tiny recipe (so the real parser checks
what users run); the harness adds only what a CPU run needs (gloo, local transformer, no fused
CUDA kernels, ``NullTokenizer``) and a synthetic corpus of short documents in Megatron's indexed
format.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tests.overrides import once_per_key
from tests.real_megatron import launch_server

REPO = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "shim"
VOCAB = 128

# What a CPU run needs; none of these changes the maths being compared.
CPU_FLAGS = [
    "--tokenizer-type",
    "NullTokenizer",
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--num-workers",
    "0",
    "--split",
    "90,5,5",
]

# A Llama-style model small enough for 2-core CI: RoPE, RMSNorm, SwiGLU, grouped-query attention.
TINY = [
    "model.num_layers=8",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    f"model.vocab_size={VOCAB}",
    "model.seq_length=64",
    "train.iters=3",
    "train.warmup_iters=1",
    "train.global_batch_size=4",
    "train.lr=0.01",
    "train.min_lr=0.001",
    "parallel.pp=1",
    "parallel.vpp=1",
    "parallel.tp=1",
    "parallel.cp=1",
    "parallel.dp=1",
]

TAG_FOR_MINOR = {(0, 16): "core_v0.16.1", (0, 17): "core_v0.17.1", (0, 18): "core_v0.18.2", (0, 19): "core_v0.19.0"}


def tags_dir() -> Path:
    return Path(os.environ.get("MEGATRON_LM_TAGS", REPO.parent / "shared" / "megatron-lm"))


def installed_megatron_core() -> tuple[int, int]:
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def installed_tag() -> Path:
    version = installed_megatron_core()
    if version not in TAG_FOR_MINOR:
        raise RuntimeError(
            f"megatron-core {version}: no Megatron-LM tag pairs with it; allowed: {sorted(TAG_FOR_MINOR)}"
        )
    path = tags_dir() / TAG_FOR_MINOR[version]
    if not (path / "pretrain_gpt.py").is_file():
        raise RuntimeError(
            f"{path}/pretrain_gpt.py: missing; the Megatron-LM tags live in ../shared/megatron-lm "
            "beside the repository (or set MEGATRON_LM_TAGS)"
        )
    return path


_RAISED = re.compile(r"^\w*(Error|Exception): ")  # the last line of a Python traceback


def megatron_args(overrides: list[str], recipe: str = "tiny-cpu") -> list[str]:
    """``megatron-slim megatron-args --recipe R --set ...``, as a user's shell would split it."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_slim.cli",
        "megatron-args",
        "--recipe",
        recipe,
        "--set",
        *once_per_key(*overrides),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed:\n{out.stderr}")
    return shlex.split(out.stdout)


def null_tokenizer_eod(vocab: int) -> int:
    """The end-of-document id of ``--tokenizer-type NullTokenizer --vocab-size vocab``: Megatron-LM
    up to core_v0.16 (its legacy tokenizer) appends it after the vocabulary (``vocab``); from 0.17
    ``megatron.core.tokenizers``' NullTokenizer takes the vocabulary's last id (``vocab - 1``)."""
    return vocab if installed_megatron_core() < (0, 17) else vocab - 1


def write_corpus(prefix: Path, *, documents: int = 400, seed: int = 0, vocab: int = VOCAB) -> Path:
    """Short documents (4..48 tokens, each ending in NullTokenizer's eod for ``vocab``, the model's
    ``--vocab-size``) whose other tokens (below ``vocab - 1``) follow a noisy bigram rule, so the loss
    has something to learn."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    ids, eod = vocab - 1, null_tokenizer_eod(vocab)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for _ in range(documents):
        length = int(rng.integers(4, 49))
        tokens = [int(rng.integers(0, ids))]
        for _ in range(length - 2):
            step = 1 if rng.random() < 0.7 else int(rng.integers(0, ids))
            tokens.append((tokens[-1] + step) % ids)
        tokens.append(eod)
        builder.add_document(numpy.array(tokens, dtype=numpy.int32), [len(tokens)])
    builder.finalize(f"{prefix}.idx")
    return prefix


@dataclass
class Run:
    """What Megatron computed, per iteration (train) and per evaluation call."""

    losses: list[float]
    grad_norms: list[float]
    eval_losses: list[float]
    skipped: int
    log: str = field(repr=False, default="")
    # per rank, per iteration: the rank's perf_counter() when Megatron logged it
    times: dict[int, list[float]] = field(repr=False, default_factory=dict)
    # per rank, per iteration: the activation recorder's record (MEGATRON_SLIM_BENCH_ACTIVATIONS=1)
    activations: dict[int, list[dict]] = field(repr=False, default_factory=dict)


def _read_records(record_dir: Path, world_size: int) -> Run:
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    evals: dict[int, float] = {}
    times: dict[int, dict[int, float]] = {}
    activations: dict[int, dict[int, dict]] = {}
    skipped = 0
    for rank in range(world_size):
        path = record_dir / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "train":
                norms.setdefault(record["iteration"], record["grad_norm"])
                if "lm loss" in record["loss"]:
                    losses[record["iteration"]] = record["loss"]["lm loss"]
                skipped = max(skipped, record["skipped"])
                if "time" in record:
                    times.setdefault(rank, {})[record["iteration"]] = record["time"]
            elif record["kind"] == "activations":
                activations.setdefault(rank, {})[record["iteration"]] = record
            elif record["kind"] == "eval" and "lm loss" in record["loss"]:
                evals[record["call"]] = record["loss"]["lm loss"]
    return Run(
        [losses[i] for i in sorted(losses)],
        [norms[i] for i in sorted(norms)],
        [evals[i] for i in sorted(evals)],
        skipped,
        times={r: [t[i] for i in sorted(t)] for r, t in times.items()},
        activations={r: [a[i] for i in sorted(a)] for r, a in activations.items()},
    )


PROCESSES = ("fork", "torchrun")


def default_processes() -> str:
    """How ``run_pretrain`` starts ranks unless told: ``MEGATRON_SLIM_TEST_LAUNCH`` (default ``fork``)."""
    processes = os.environ.get("MEGATRON_SLIM_TEST_LAUNCH", "fork")
    if processes not in PROCESSES:
        raise RuntimeError(f"MEGATRON_SLIM_TEST_LAUNCH={processes!r}: allowed {', '.join(PROCESSES)}")
    return processes


def run_pretrain(
    nproc: int,
    flags: list[str],
    workdir: Path,
    *,
    launcher: bool,
    data_prefix: Path,
    timeout_s: int = 600,
    env: Optional[dict] = None,
    processes: Optional[str] = None,
) -> Run:
    """``torchrun --standalone --nproc_per_node N [-m megatron_slim.launch] pretrain_gpt.py FLAGS``.

    ``processes="torchrun"`` runs exactly that; ``"fork"`` (``default_processes()``) runs the same
    ranks, with the same environment, folder and command line, forked from this test process's
    launch server (``forkrun.py``), which imported torch, the CPU shim and Megatron-LM once: a
    launch then costs a few seconds less per rank."""
    tag = installed_tag()
    record_dir = workdir / "records"
    record_dir.mkdir(parents=True, exist_ok=True)
    processes = processes or default_processes()
    if processes not in PROCESSES:
        raise ValueError(f"processes={processes!r}: allowed {', '.join(PROCESSES)}")
    module = ["-m", "megatron_slim.launch"] if launcher else []
    script_and_flags = [str(tag / "pretrain_gpt.py"), *flags, *CPU_FLAGS, "--data-path", str(data_prefix)]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC"))}
    base_env.update(
        PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]),
        MEGATRON_SLIM_TEST_CPU_SHIM="1",
        MEGATRON_SLIM_TEST_RECORD=str(record_dir),
        OMP_NUM_THREADS="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    run_env = {**base_env, **(env or {})}
    if processes == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        cmd += module + script_and_flags
        try:
            done = subprocess.run(cmd, env=run_env, cwd=workdir, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{shlex.join(cmd)}: no result within {timeout_s}s\n{(exc.stdout or '')[-4000:]}"
            ) from exc
        log, code = done.stdout + done.stderr, done.returncode
    else:
        cmd = ["forkrun", str(nproc), *module, *script_and_flags]
        log_path = workdir / "launch.log"
        request = dict(
            nproc=nproc,
            module=module[1] if module else None,
            script=script_and_flags[0],
            args=script_and_flags[1:],
            env=run_env,
            cwd=str(workdir),
            log=str(log_path),
        )
        try:
            code = launch_server.launch(tag, request, base_env, timeout_s)
        except launch_server.LaunchTimeout as exc:
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            raise AssertionError(f"{shlex.join(cmd)}: {exc}\n{log[-4000:]}") from exc
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
    if code != 0:
        # every rank's error lines first: the tail may be another rank's output (its argument table,
        # a stack dump when the launch stopped it) and not the refusal that ended the launch
        errors = "\n".join(line for line in log.splitlines() if " error: " in line or _RAISED.match(line))
        raise AssertionError(f"{shlex.join(cmd)} exited {code}:\n{errors}\n...\n{log[-6000:]}")
    run = _read_records(record_dir, nproc)
    run.log = log
    return run


def relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise AssertionError(f"different or empty series: {a} vs {b}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def assert_trains_as(run: Run, reference: Run, tolerance: float, iterations: int = 3) -> tuple[float, float]:
    """``run`` took every step, the reference trained, and both agree to ``tolerance`` in every
    iteration's loss and gradient norm; returns those two relative differences."""
    assert len(reference.losses) == iterations and run.skipped == reference.skipped == 0
    assert reference.losses[-1] < reference.losses[0]  # it trained
    loss_diff = relative_difference(run.losses, reference.losses)
    norm_diff = relative_difference(run.grad_norms, reference.grad_norms)
    assert loss_diff <= tolerance, (run.losses, reference.losses)
    assert norm_diff <= tolerance, (run.grad_norms, reference.grad_norms)
    return loss_diff, norm_diff

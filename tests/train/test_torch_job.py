"""`megatron-slim train` as a torch job: under torchrun it trains the same losses as its own ranks;
its own rank processes never outlive it (SIGTERM, SIGKILL); a wrong WORLD_SIZE fails before any work."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_slim.cli import main
from megatron_slim.megatron.fallback_warnings import FALLBACK_MESSAGES
from tests.overrides import once_per_key
from tests.processes import running
from tests.train.conftest import SMALL_DATA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["parallel.pp=2", "train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1"]


def _env():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.multi
def test_torchrun_trains_the_same_losses_as_the_spawned_ranks(tmp_path):
    """torchrun first, on an empty corpus cache: local rank 0 prepares it while rank 1 waits, then reads it;
    the spawned run then finds it cached."""
    cache = tmp_path / "cache"
    sets = once_per_key(f"data.cache_dir={cache}", *SMALL_DATA, *TINY, "train.iters=2")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "megatron_slim",
            "train",
            "--set",
            *sets,
            "--json",
            str(tmp_path / "torchrun.json"),
        ],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # exactly one rank says what it did and reports: one data line, one plan line, one summary
    assert run.stdout.count("data: ") == 1 and "(prepared in" in run.stdout
    assert run.stdout.count("recipe tiny-cpu: 2 CPU ranks under torchrun") == 1 and run.stdout.count("done: loss") == 1
    # one line names the backends instead of megatron-core's per-rank "Apex/TE not installed" warnings
    assert run.stdout.count("backends: attention ") == 1
    assert not any(m in run.stdout + run.stderr for m in FALLBACK_MESSAGES)
    entries = [p for p in (cache / "corpora").iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and entries[0].is_dir() and not entries[0].name.startswith(".")  # no staging left
    assert main(["train", "--set", *sets, "--json", str(tmp_path / "own.json")]) == 0
    own, launched = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("own", "torchrun"))
    assert launched["losses"] == own["losses"] and launched["loss_iterations"] == [1, 2]
    assert launched["stages"] == own["stages"] and launched["schedule_digest"] == own["schedule_digest"]


def test_wrong_world_size_under_torchrun_fails_before_any_work(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    for k, v in dict(
        RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "never-made"
    assert main(["train", "--set", "parallel.pp=2", f"data.cache_dir={cache}"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE" in err and "tp*pp*cp*dp = 1*2*1*1 = 2" in err and "got 4" in err
    assert not cache.exists()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                kids.append(int(entry))
    return sorted(kids)


def _start_training(tmp_path, data_cache, *extra):
    """`python -m megatron_slim train` on 2 ranks, long enough to be stopped; returns it and its rank
    PIDs once both ranks train (an iteration line is printed)."""
    out, err = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")  # noqa: SIM115 (outlive this call)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_slim",
            "train",
            "--set",
            *once_per_key(
                f"data.cache_dir={data_cache}",
                *SMALL_DATA,
                *TINY,
                "model.seq_length=64",
                "train.iters=100000",
                "train.log_interval=1",
            ),
            *extra,
        ],
        env=_env(),
        cwd=tmp_path,
        stdout=out,
        stderr=err,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    ranks = []
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "stderr").read_text()[-4000:]
        ranks = _children(proc.pid)
        if len(ranks) == 2 and "iter " in (tmp_path / "stdout").read_text():
            return proc, ranks
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"ranks {ranks} did not start training within 300 s")


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if running(p)]


@pytest.mark.multi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "sig",
    [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="ctrl-c", marks=pytest.mark.slow)],
)
def test_terminated_train_stops_its_ranks_and_says_so(tmp_path, data_cache, sig):
    """SIGTERM to the parent alone; Ctrl-C: SIGINT to the whole process group, ranks included."""
    proc, ranks = _start_training(tmp_path, data_cache)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    code = proc.wait(timeout=30)
    assert _wait_gone(ranks, 5) == []
    assert code == 128 + sig
    stderr = (tmp_path / "stderr").read_text()
    assert stderr.strip().splitlines()[-1].startswith("megatron-slim train: interrupted by " + signal.Signals(sig).name)
    assert "Traceback" not in stderr


# slow: the default tier kills a caller of forked ranks outright
# (tests/runtime/test_spawn.py::test_forked_ranks_die_with_a_caller_killed_outright: the same die_with_parent)
@pytest.mark.multi
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_killed_train_leaves_no_rank_behind(tmp_path, data_cache):
    proc, ranks = _start_training(tmp_path, data_cache)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _wait_gone(ranks, 5) == []


# slow: the watchdog's mechanism is in the default tier
# (tests/runtime/test_spawn.py::test_a_rank_that_stops_responding_is_named_with_its_step_and_every_rank_is_stopped)
@pytest.mark.multi
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_stopped_rank_stops_the_run_naming_it_and_its_iteration(tmp_path, data_cache):
    proc, ranks = _start_training(tmp_path, data_cache, "--rank-timeout", "5")
    os.kill(ranks[1], signal.SIGSTOP)
    code = proc.wait(timeout=120)
    assert _wait_gone(ranks, 10) == []
    stderr = (tmp_path / "stderr").read_text()
    assert code != 0 and "Traceback" not in stderr.splitlines()[-1]
    assert "stopped responding" in stderr and "last at iteration " in stderr

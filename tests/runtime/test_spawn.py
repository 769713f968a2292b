import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_slim.runtime import rank_start, spawn
from megatron_slim.runtime.spawn import RankFailed, run_ranks
from tests.processes import running
from tests.runtime import _spawn_fns

ROOT = Path(__file__).resolve().parents[2]


def test_run_ranks_returns_results_in_rank_order_and_ranks_join_the_parents_store(monkeypatch):
    made = []

    def recording(*args, **kwargs):
        store = real(*args, **kwargs)
        made.append(store.port)
        return store

    real = spawn.host_rendezvous
    monkeypatch.setattr(spawn, "host_rendezvous", recording)
    envs = run_ranks(_spawn_fns.rendezvous_env, 3)
    assert [e["sum"] for e in envs] == [3.0, 3.0, 3.0]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert len(made) == 1 and {e["MASTER_PORT"] for e in envs} == {str(made[0])}


def test_failure_on_one_rank_raises_with_its_traceback():
    with pytest.raises(RankFailed, match="boom on rank 1"):
        run_ranks(_spawn_fns.fail_on_one, 2, timeout_s=60)


def test_rendezvous_port_is_held_by_the_parent_from_the_moment_it_is_chosen():
    """No choose-close-rebind window (the old free_port() race): a second server on the port fails."""
    store = spawn.host_rendezvous(timeout_s=5)
    assert store.port > 0
    with pytest.raises(dist.DistNetworkError, match="address already in use"):
        dist.TCPStore(spawn.HOST, store.port, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(spawn.HOST, store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert not hasattr(spawn, "free_port")


@pytest.mark.slow
def test_concurrent_runs_each_get_their_own_rendezvous():
    """Several run_ranks at once (from threads, so without signal handlers) never collide on a port;
    each rank sees torchrun's variables pointing at its own parent's store."""
    results, errors = {}, []

    def one(i):
        try:
            results[i] = run_ranks(_spawn_fns.rendezvous_env, 2, timeout_s=240)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ports = {r[0]["MASTER_PORT"] for r in results.values()}
    assert len(ports) == 3
    for envs in results.values():
        assert [e["RANK"] for e in envs] == ["0", "1"] and {e["MASTER_PORT"] for e in envs} == {envs[0]["MASTER_PORT"]}


def test_ranks_start_the_way_the_suite_asked_and_see_what_a_spawned_rank_sees(capfd, monkeypatch, tmp_path):
    """The suite starts ranks from a preloaded fork server (tests/conftest.py) unless told to spawn;
    either way each rank is its own process with the caller's environment variables and working
    folder as they are now, and what it prints reaches this test's output."""
    expected = os.environ.get("MEGATRON_SLIM_TEST_START", "forkserver")
    assert rank_start.start_method() == expected
    monkeypatch.setenv("MEGATRON_SLIM_TEST_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = run_ranks(_spawn_fns.print_rank, 2)
    assert (ranks[0][0] == os.getpid()) == (expected == "spawn") and ranks[0][0] == ranks[1][0]
    assert all(probe == "set after the server started" and cwd == str(tmp_path) for _, probe, cwd in ranks)
    out = capfd.readouterr().out
    assert "rank 0 of 2 says hello" in out and "rank 1 of 2 says hello" in out


CALLER = """
import sys
from megatron_slim.runtime import rank_start, spawn
from tests.runtime import _spawn_fns

if __name__ == "__main__":
    rank_start.use_forkserver(["torch"])
    spawn.run_ranks(_spawn_fns.write_pid_and_sleep, 2, sys.argv[1])
"""


@pytest.mark.multi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only; reads /proc")
def test_forked_ranks_die_with_a_caller_killed_outright(tmp_path):
    """A rank's parent is the fork server, not the caller; SIGKILL to the caller still takes the
    ranks down (the server exits when its caller does, and the ranks die with the server)."""
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert caller.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        ranks = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    finally:
        caller.kill()
    caller.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in ranks if running(p)]
    for pid in left:  # leave nothing behind when failing
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_a_rank_killed_outright_is_named_before_the_peers_it_made_fail():
    with pytest.raises(RankFailed) as failed:
        run_ranks(_spawn_fns.killed_while_the_other_waits, 2, timeout_s=120, collective_timeout_s=60)
    assert str(failed.value).startswith("rank 1 died (killed by SIGKILL) without a result")


def test_a_rank_that_stops_responding_is_named_with_its_step_and_every_rank_is_stopped():
    """SIGSTOP on one rank would hang its peer in the barrier until the collective timeout (here a
    minute) with no message; the watchdog names it after ``watchdog_s`` without a heartbeat."""
    began = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_spawn_fns.stopped_while_the_other_waits, 2, timeout_s=120, collective_timeout_s=60, watchdog_s=3)
    assert str(failed.value).startswith("rank 1 stopped responding (") and "last at the test's stop" in str(
        failed.value
    )
    assert time.monotonic() - began < 45

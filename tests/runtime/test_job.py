"""Reading torchrun's environment (no processes started)."""

import pytest

from megatron_slim.plan.schema import ConfigError
from megatron_slim.runtime.job import LaunchedRank, launched_rank, threads_per_rank

TORCHRUN = dict(
    RANK="3",
    WORLD_SIZE="4",
    LOCAL_RANK="1",
    LOCAL_WORLD_SIZE="2",
    MASTER_ADDR="node0",
    MASTER_PORT="29500",
    TORCHELASTIC_RUN_ID="job7",
    GROUP_RANK="1",
)


def test_not_launched_without_torchrun_or_a_full_rank_environment():
    assert launched_rank({}) is None
    assert launched_rank({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no rendezvous address: not a rank


def test_torchrun_environment():
    job = launched_rank(TORCHRUN)
    assert job == LaunchedRank(
        rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="node0", master_port=29500, run_id="job7"
    )
    assert job.launcher == "torchrun"


def test_plain_launcher_environment_defaults_local_values():
    job = launched_rank(dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1234"))
    assert (job.local_rank, job.local_world_size, job.run_id) == (1, 2, None)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"RANK": None}, "RANK"),
        ({"MASTER_PORT": ""}, "MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT: not an integer in 1\.\.65535 \(got '70000'\)"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "4"}, "RANK=4"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK"),
    ],
)
def test_broken_torchrun_environment_is_named(change, named):
    env = {**TORCHRUN, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ConfigError, match=named):
        launched_rank(env)


def test_threads_follow_omp_num_threads_else_share_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(8) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_per_rank(10**6) == 1


def test_a_taken_master_port_is_named_in_one_line(monkeypatch):
    """Rank 0 serves the rendezvous on MASTER_PORT; a port another process holds is a ConfigError
    naming MASTER_ADDR and MASTER_PORT, not torch's DistNetworkError traceback."""
    import socket

    from megatron_slim.runtime.job import joined

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        job = launched_rank(env)
        refused = f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}: rank 0 could not join"
        with pytest.raises(ConfigError, match=refused), joined(job, timeout_s=20):
            pass

import threading

import pytest
import torch.distributed as dist

from megatron_slim.runtime import spawn
from megatron_slim.runtime.spawn import RankFailed, run_ranks
from tests.runtime import _spawn_fns


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

"""The check the train-path tests under tensor parallelism share: each rank's gradients against its
TP shard of the single-process reference's, and every parameter covered by some rank."""

import torch

TOL = dict(atol=2e-5, rtol=1e-4)


def assert_tp_shard_grads(results, ref_grads) -> None:
    """``results``: per rank a dict with ``rank``, ``grads`` (by global name) and ``want`` (the
    reference's shard of each of them, ``megatron/model/weights.tp_shard``)."""
    covered = set()
    for r in results:
        assert r["grads"].keys() == r["want"].keys() and r["grads"]
        for name, want in r["want"].items():
            got, where = r["grads"][name], f"{r['rank']} {name}"
            assert got is not None and got.shape == want.shape, where
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, where=where: f"{where}: {m}")
        covered |= r["want"].keys()
    assert covered == ref_grads.keys()  # every parameter of the model, on some rank

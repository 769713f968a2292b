"""The NCCL-rules checker (megatron_slim/runtime/nccl_rules) on gloo: what gloo lets through and NCCL
would not fails, naming both ends; what NCCL accepts passes with the right data."""

from megatron_slim.runtime import nccl_rules
from megatron_slim.runtime.spawn import run_ranks
from tests.runtime import _nccl_rules_workers as workers

ALL = tuple(s.__name__ for s in workers.SCENARIOS)
HIDDEN_BY_GLOO = ("swapped_receives", "crossed_sends", "crossed_receives")


def test_gloo_alone_passes_the_swapped_and_the_crossed_messages(monkeypatch):
    monkeypatch.delenv(nccl_rules.ENV, raising=False)  # the ranks take this environment
    results = run_ranks(workers.run_scenarios, 2, False, HIDDEN_BY_GLOO, timeout_s=120)
    assert results == [dict.fromkeys(HIDDEN_BY_GLOO, "ok")] * 2


def test_the_checker_fails_what_nccl_would_not_run_and_passes_the_rest():
    sender, receiver = run_ranks(workers.run_scenarios, 2, True, ALL, timeout_s=120)
    site = "tests/runtime/_nccl_rules_workers.py:"
    for ok in ("in_order", "crossed_in_one_batch", "ordered_by_parity"):
        assert sender[ok] == receiver[ok] == "ok", ok
    swapped = receiver["swapped_receives"]
    assert swapped.startswith("broken:") and "NCCL ignores tags" in swapped
    assert f"{site}14 in swapped_receives (tag 1" in swapped and f"{site}19 in swapped_receives (tag 2" in swapped
    assert "differ in size or dtype" in receiver["size_mismatch"] and "torch.bfloat16" in receiver["size_mismatch"]
    for rank in (sender, receiver):
        assert (
            "would deadlock once messages outgrow" in rank["crossed_sends"]
            and "batch_isend_irecv" in rank["crossed_sends"]
        )
        assert "would deadlock: rank" in rank["crossed_receives"] and "in one order on both" in rank["crossed_receives"]
        assert (
            "rank 0: all_reduce #0" in rank["different_collectives"]
            and "rank 1: broadcast #0" in rank["different_collectives"]
        )
        assert "different sizes" in rank["different_sizes"] and "5, None" in rank["different_sizes"]
        assert "member 0 sends 1 rows to member 1" in rank["uneven_all_to_all"]
    assert "any source" in receiver["any_source"] and sender["any_source"] == "ok"

"""``ContextExchange`` bookkeeping in one process: each end's role, the CP shard arithmetic (a CP
rank ships its rows of the query slice and of the moved whole slices), and the refusals."""

import pytest

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.ir import Action
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange, paired_role

# pp2 x vpp2, 64-token slices: rank 1's chunk 1 sends slice 3 of microbatch 0 to rank 0's chunk 0
PLAN = ExchangePlan.from_text("8 1 1F0.3 0 F1.0 0 128\n")
LENGTHS = (64, 64, 64, 64)


def _exchange(rank, shards=1):
    return ContextExchange(PLAN, rank, group=None, pp_ranks=[0, 1], lengths=LENGTHS, shards=shards)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_each_end_knows_its_role_and_its_cp_shard(shards):
    sender, peer = _exchange(1, shards), _exchange(0, shards)
    with sender.scope(Action.parse("1F0.3")):
        role = sender.role
        assert (role.sender, role.other, role.query_rows, role.moved_rows) == (True, 0, 64 // shards, 128 // shards)
        assert sender.moved_chunks([64 // shards] * 3) == 2  # the two oldest whole slices
        sender._layer = 1  # as if a layer ran
    with peer.scope(Action.parse("F1.0")):
        assert (peer.role.sender, peer.role.other, peer.role.moved_rows) == (False, 1, 128 // shards)
        peer._layer = 1
    with sender.scope(Action.parse("F0.3")):  # chunk 0's action is another action: not paired
        assert sender.role is None


def test_a_move_that_is_not_whole_cached_slices_is_refused():
    sender = _exchange(1, shards=2)
    with pytest.raises(RuntimeError, match="not a whole number"), sender.scope(Action.parse("1F0.3")):
        sender.moved_chunks([48, 48, 48])


def test_a_paired_action_that_runs_no_attention_is_refused():
    with pytest.raises(RuntimeError, match="ran no attention layer"), _exchange(0).scope(Action.parse("F1.0")):
        pass


def test_packed_documents_are_refused_and_a_recomputed_forward_is_not_paired():
    peer = _exchange(0)
    assert paired_role(None, True, True) is None and paired_role(peer, True, True) is None  # outside a pair
    packed = pytest.raises(ValueError, match="allowed: unpacked batches")
    with packed, peer.scope(Action.parse("F1.0")):
        assert paired_role(peer, False, False) is peer.role and peer.role is not None
        assert paired_role(peer, False, True) is None  # a forward rebuilt inside a backward runs locally
        paired_role(peer, True, False)

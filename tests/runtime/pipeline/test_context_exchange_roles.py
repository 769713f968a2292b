"""``ContextExchange`` bookkeeping in one process: each end's role, the server a taker starts (one
per block without CP, one plan-order server under CP; stubbed: no process group here), the ``DONE``
headers a sender posts, and the refusals."""

import pytest

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.ir import Action
from megatron_slim.runtime.pipeline import context_exchange
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange, paired_role
from megatron_slim.runtime.pipeline.exchange_server import ServedBlock
from megatron_slim.runtime.pipeline.exchange_wire import DONE, layer_tag

# pp2 x vpp2, 64-token slices: rank 1's chunk 1 sends slice 3 of microbatch 0 to rank 0's chunk 0
PLAN = ExchangePlan.from_text("8 1 1F0.3 0 F1.0 0 128\n")
LENGTHS = (64, 64, 64, 64)
# pp3: rank 2's B0.3 splits [0, 100) over two takers (a boundary inside slice 1); rank 0's F1.0
# serves it and rank 1's F0.3 too (a backward block served by a forward action)
BLOCKS = ExchangePlan.from_text("5 2 B0.3 0 F1.0 0 40\n5 2 B0.3 1 F2.1 40 100\n5 1 F0.3 0 F1.0 0 64\n")


class _StubServer:
    """Records what a taker's server would serve; ``join`` reports two layers per block."""

    started: list = []
    cp_groups: list = []

    def __init__(self, blocks, group, device, backend_for, cp_group=None, after=None) -> None:
        self.blocks, self.after = list(blocks), after
        _StubServer.cp_groups.append(cp_group)

    def start(self) -> None:
        _StubServer.started.append(self.blocks)

    def join(self) -> int:
        return 2 * len(self.blocks)


class _Sent:
    def wait(self) -> None:
        pass


@pytest.fixture(autouse=True)
def stub_server(monkeypatch):
    _StubServer.started, _StubServer.cp_groups = [], []
    monkeypatch.setattr(context_exchange, "BlockServer", _StubServer)
    monkeypatch.setattr(context_exchange, "CPBlockServer", _StubServer)
    return _StubServer


@pytest.fixture(autouse=True)
def sent(monkeypatch):
    """(destination, tag, header batch) of every message a sender posts (no process group here)."""
    messages: list = []

    def isend(tensor, dst, group, tag):
        messages.append((dst, tag, int(tensor[0])))
        return _Sent()

    monkeypatch.setattr(context_exchange.dist, "isend", isend)
    return messages


CP_GROUP = object()  # stands for the exchange's CP group


def _exchange(rank, shards=1, plan=PLAN, pp_ranks=(0, 1)):
    cp_group = CP_GROUP if shards > 1 else None
    return ContextExchange(plan, rank, group=None, pp_ranks=list(pp_ranks), shards=shards, cp_group=cp_group)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_each_end_knows_its_role_and_its_server(shards, stub_server, sent):
    sender, peer = _exchange(1, shards), _exchange(0, shards)
    with sender.scope(Action.parse("1F0.3")):
        role = sender.role
        assert (role.sender, role.other, role.moved) == (True, 0, 128)
        sender._layer = 3  # as if three layers ran
    with peer.scope(Action.parse("F1.0")):
        assert (peer.role.sender, peer.role.other, peer.role.moved) == (False, 1, 128)
        peer._layer = 1
    assert sent == [(0, layer_tag(0, 3), DONE)]  # the block's end, after layer 2
    assert stub_server.started == [[ServedBlock(0, 1, False)]]
    assert stub_server.cp_groups == [CP_GROUP if shards > 1 else None]
    assert peer.served_blocks == 0  # the server runs on past the taker's action ...
    peer.drain()
    assert peer.served_blocks == 2  # ... until the schedule's end
    with sender.scope(Action.parse("F0.3")):  # chunk 0's action is another action: not paired
        assert sender.role is None


def test_a_sender_with_several_blocks_and_a_taker_serving_several_senders(stub_server):
    sender = _exchange(2, plan=BLOCKS, pp_ranks=(10, 11, 12))
    role = sender._roles[Action.parse("B0.3")]
    assert role.sender and role.moved == 100
    assert [(b.index, b.other, b.kv_start, b.kv_end, b.backward) for b in role.blocks] == [
        (0, 0, 0, 40, True),
        (1, 1, 40, 100, True),
    ]
    taker = _exchange(0, plan=BLOCKS, pp_ranks=(10, 11, 12))
    with taker.scope(Action.parse("F1.0")):
        assert paired_role(taker, False, False) is None  # its own attention is plain; the server serves
    assert stub_server.started == [[ServedBlock(0, 12, True), ServedBlock(2, 11, False)]]  # global ranks
    taker.drain()
    assert taker.served_blocks == 4


def test_cp_runs_any_block_plan_and_a_cp_taker_needs_its_group(stub_server):
    taker = _exchange(0, shards=2, plan=BLOCKS, pp_ranks=(0, 1, 2))
    with taker.scope(Action.parse("F1.0")):
        pass
    assert stub_server.started == [[ServedBlock(0, 2, True), ServedBlock(2, 1, False)]]
    assert stub_server.cp_groups == [CP_GROUP]
    bare = ContextExchange(BLOCKS, 0, group=None, pp_ranks=[0, 1, 2], shards=2)
    with pytest.raises(ValueError, match=r"cp=2: a taker needs cp_group"), bare.scope(Action.parse("F1.0")):
        pass


@pytest.mark.parametrize("rank,action,shards", [(1, "1F0.3", 1), (1, "1F0.3", 2)])
def test_an_exchanging_action_that_runs_no_attention_is_refused(rank, action, shards):
    with (
        pytest.raises(RuntimeError, match="ran no attention layer"),
        _exchange(rank, shards).scope(Action.parse(action)),
    ):
        pass


@pytest.mark.parametrize("rank,action,shards", [(0, "F1.0", 2), (0, "F1.0", 1), (1, "1F0.3", 1)])
def test_packed_documents_are_refused_and_a_recomputed_forward_is_not_paired(rank, action, shards):
    end = _exchange(rank, shards)
    assert paired_role(None, True, True) is None and paired_role(end, True, True) is None  # outside a pair
    packed = pytest.raises(ValueError, match="allowed: unpacked batches")
    with packed, end.scope(Action.parse(action)):
        end._layer = 1
        expected = end.role if end.role.sender else None  # a taker's blocks: its server
        assert paired_role(end, False, False) is expected and end.role is not None
        assert paired_role(end, False, True) is None  # a forward rebuilt inside a backward runs locally
        paired_role(end, True, False)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_taker_moves_on_while_its_server_runs_and_cp_servers_queue(shards, stub_server):
    plan = ExchangePlan.from_text("5 1 F0.3 0 F1.0 0 64\n6 1 F0.4 0 B0.0 0 64\n")
    taker = _exchange(0, shards=shards, plan=plan, pp_ranks=(0, 1))
    for action in ("F1.0", "B0.0"):
        with taker.scope(Action.parse(action)):
            pass
    first, second = taker._servers
    assert second.after is (first if shards > 1 else None)  # CP collectives of one server at a time
    assert taker.served_blocks == 0
    taker.drain()
    assert taker.served_blocks == 4 and taker._servers == []

"""One decoder layer's forward or backward pass on every CP rank, as a task graph.

Forward, per rank (``t`` = its attention-layout tokens, ``b`` = its balanced-layout tokens):

    pre(t) -> attention groups -> post(t) -> [remap a2a] -> mlp(b) -> [remap back a2a]

Backward mirrors it: ``[remap a2a] -> mlp'(b) -> [remap back a2a] -> post'(t) -> attention
groups' backward -> pre'(t)``. Without remapping ``b = t`` and there is no all-to-all. The
remap all-to-all synchronises pairs of ranks that exchange tokens, not all ranks (NCCL runs it as
grouped sends and receives). Every pass starts with all ranks at time 0 and ends when the last
rank is done: layers are identical, so the rank that is slowest in one layer is slowest in every
layer, and rings and collectives couple the ranks anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.program import lower_cp
from megatron_slim.plan.cp.remap import RemapPlan
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.sim.cp.attention import AttentionBuilder
from megatron_slim.plan.sim.cp.events import Deps, Span, TaskGraph, Timeline, run, spans
from megatron_slim.plan.sim.cp.network import Network

_LINEAR = (-1, 0, 0, 0)  # linear work outranks attention pieces when both are ready


@dataclass
class PassResult:
    time_s: float
    busy: dict[int, dict[str, float]]
    sent: list[dict[str, float]]
    comm_s: list[float]  # seconds each rank's outgoing links were busy
    spans: list[Span] = field(default_factory=list)  # with record=True: every task and link load, for traces
    walked: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (rank, group) -> steps priced


def _remap(
    net: Network, remap: RemapPlan, per_token: float, ready: dict[int, tuple[int, ...]], name: str
) -> dict[int, list[int]]:
    """The remap all-to-all as the grouped sends/receives it is: a pair's transfer starts once both
    ranks have entered the call, and a rank continues once its own transfers are done (a rank with
    nothing to move does not wait for anyone)."""
    pairs: dict[tuple[int, int], int] = {}
    for t in remap.transfers:
        pairs[(t.src, t.dst)] = pairs.get((t.src, t.dst), 0) + t.tokens
    after = {r: list(ready[r]) for r in ready}
    for (src, dst), tokens in sorted(pairs.items()):
        tid = net.transfer(src, dst, tokens * per_token, ready[src] + ready[dst], name)
        after[src].append(tid)
        after[dst].append(tid)
    return after


def simulate_pass(
    plan: CPPlan,
    topo: CPTopology,
    costs: CPCosts,
    *,
    backward: bool,
    remap: RemapPlan | None = None,
    routing: RoutingPlan | None = None,
    record: bool = False,
) -> PassResult:
    num_ranks = plan.num_ranks
    graph = TaskGraph(num_ranks)
    ranks = range(num_ranks)
    net = Network(topo, graph)
    attn_tokens = plan.tokens_per_rank()
    mlp_tokens = remap.target_tokens if remap else attn_tokens

    def linear(r: int, sec: float, deps: Deps, name: str) -> int:
        return graph.compute(r, sec, deps, _LINEAR, "linear", name)

    attention = AttentionBuilder(plan, costs, net, routing, backward, lower_cp(plan, routing))

    def attention_pass(ready: dict[int, int]) -> dict[int, list[int]]:
        finals: dict[int, list[int]] = {r: [ready[r]] for r in ranks}
        for group in plan.groups:
            for r, tids in attention.build(group, ready).items():
                finals[r].extend(tids)
        return finals

    if not backward:
        pre = {r: linear(r, costs.pre_fwd_s * attn_tokens[r], (), "pre (norm, QKV, RoPE)") for r in ranks}
        finals = attention_pass(pre)
        post = {r: linear(r, costs.post_fwd_s * attn_tokens[r], finals[r], "post (output projection)") for r in ranks}
        if remap:
            moved = _remap(net, remap, costs.hidden_bytes, {r: (post[r],) for r in ranks}, "remap")
            mlp = [linear(r, costs.mlp_fwd_s * mlp_tokens[r], moved[r], "mlp") for r in ranks]
            _remap(net, remap.inverse(), costs.hidden_bytes, {r: (mlp[r],) for r in ranks}, "remap back")
        else:
            for r in ranks:
                linear(r, costs.mlp_fwd_s * mlp_tokens[r], (post[r],), "mlp")
    else:
        if remap:
            moved = _remap(net, remap, costs.hidden_bytes, {r: () for r in ranks}, "remap")
            mlp = [linear(r, costs.mlp_bwd_s * mlp_tokens[r], moved[r], "mlp") for r in ranks]
            post_deps: Mapping[int, Sequence[int]] = _remap(
                net, remap.inverse(), costs.hidden_bytes, {r: (mlp[r],) for r in ranks}, "remap back"
            )
        else:
            post_deps = {r: (linear(r, costs.mlp_bwd_s * mlp_tokens[r], (), "mlp"),) for r in ranks}
        post = {
            r: linear(r, costs.post_bwd_s * attn_tokens[r], post_deps[r], "post (output projection)") for r in ranks
        }
        finals = attention_pass(post)
        for r in ranks:
            linear(r, costs.pre_bwd_s * attn_tokens[r], finals[r], "pre (norm, QKV, RoPE)")
    return _result(graph, net, attention, record)


def _result(graph: TaskGraph, net: Network, attention: AttentionBuilder, record: bool) -> PassResult:
    """Run the pass's task graph and collect what ``simulate_pass`` reports."""
    timeline: Timeline = run(graph)
    comm = [0.0] * graph.num_ranks
    for (kind, rank), sec in timeline.resource_busy.items():
        if kind.endswith("_out"):
            comm[rank] += sec
    return PassResult(
        timeline.makespan, timeline.busy, net.sent, comm, spans(graph, timeline) if record else [], attention.walked
    )

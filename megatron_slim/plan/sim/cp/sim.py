"""Simulate a batch of packs under a context-parallel engine: iteration time, tokens/s, MFU.

Semantics: the CP domain has ``C = parallel.cp`` ranks (``dp = pp = 1``); a microbatch is one pack
of ``model.seq_length`` tokens; an iteration runs ``train.global_batch_size`` packs one after the
other. A pack costs ``num_layers x (forward + backward of one layer)``, each pass simulated on the
network model (``layer.py``); the embedding, output layer, loss, gradient reduction and
optimizer step are left out (they cost every engine the same). MFU counts the model FLOPs of the
decoder layers (GEMMs plus causal attention within each sequence, backward = 2x forward) against
``C * tp`` GPUs at peak.

The plan of each pack comes from ``plan.cp.engines.plan_pack``; Zeppelin adds its remap plan (when
``cp.remap``) and its routing plan, and the simulator consumes exactly those values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.engines import plan_pack, uses_remap
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.remap import RemapPlan, plan_remap_for
from megatron_slim.plan.cp.routing import plan_routing
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.cp.zigzag import causal
from megatron_slim.plan.progress import Progress, report
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schema import fail
from megatron_slim.plan.sim.cp.events import Span
from megatron_slim.plan.sim.cp.layer import PassResult, simulate_pass


@dataclass
class RankStats:
    """Per rank, summed over the iteration (all layers of all packs)."""

    rank: int
    attention_s: float = 0.0
    linear_s: float = 0.0
    idle_s: float = 0.0  # waiting on communication or on other ranks
    comm_s: float = 0.0  # seconds its outgoing NVLink and NIC were busy
    intra_node_bytes: float = 0.0
    inter_node_bytes: float = 0.0
    attention_tokens: int = 0  # summed over packs
    linear_tokens: int = 0


@dataclass
class PackResult:
    index: int
    num_sequences: int
    longest: int
    forward_layer_s: float
    backward_layer_s: float
    time_s: float
    digest: str
    plan: dict[str, Any]
    remapped_tokens: int = 0
    remapped_inter_node_tokens: int = 0


@dataclass
class LayerPass:
    """One decoder layer's forward or backward pass of one pack, as the event engine ran it (times
    from the pass's start); every layer of the pack repeats it."""

    pack: int
    phase: str  # "forward" | "backward"
    time_s: float
    spans: list[Span]


@dataclass
class CPSimResult:
    engine: str
    recipe: str
    hardware: str
    num_ranks: int
    ranks_per_node: int
    num_layers: int
    pack_length: int
    remap: bool
    routing: bool
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    packs: list[PackResult] = field(default_factory=list)
    ranks: list[RankStats] = field(default_factory=list)
    passes: list[LayerPass] = field(default_factory=list)  # simulate_cp(record=True) only; not in JSON

    def to_json(self) -> dict[str, Any]:
        out = asdict(dataclasses.replace(self, passes=[]))
        del out["passes"]
        out["num_packs"] = len(self.packs)
        out["tokens"] = self.pack_length * len(self.packs)
        return out


def cp_setup(recipe: Recipe, calibration: Calibration | None = None) -> tuple[CPTopology, CPCosts]:
    """Topology and unit costs of a recipe's CP domain (kernel rates from ``calibration`` where
    given); rejects what the CP model does not cover."""
    p = recipe.parallel
    if p.pp != 1:
        raise fail("parallel.pp", p.pp, "1 for context-parallel simulation (one pipeline stage holds all layers)")
    if p.dp != 1:
        raise fail(
            "parallel.dp",
            p.dp,
            "1 for context-parallel simulation (packs run one after another "
            "on one CP domain; scale train.global_batch_size instead)",
        )
    if recipe.train.micro_batch_size != 1:
        raise fail("train.micro_batch_size", recipe.train.micro_batch_size, "1 (a microbatch is one pack)")
    topo = CPTopology.from_hardware(recipe.hardware_profile, p.cp, p.tp)
    return topo, CPCosts.from_recipe(recipe, CostModel(recipe, calibration=calibration))


def simulate_cp(
    recipe: Recipe,
    engine: str,
    packs: tuple[tuple[int, ...], ...],
    *,
    remap: bool | None = None,
    routing: bool = True,
    hierarchical: bool = True,
    baselines: bool = True,
    topo: CPTopology | None = None,
    costs: CPCosts | None = None,
    record: bool = False,
    progress: Progress | None = None,
) -> CPSimResult:
    """``remap`` defaults to the recipe's ``cp.remap`` (only Zeppelin remaps); ``routing`` and
    ``hierarchical`` switch Zeppelin's routing layer and its a2a+ring inter-node splits off,
    ``baselines=False`` its pricing of the other engines' placements;
    ``record`` keeps every pack's layer passes (``CPSimResult.passes``) for a trace;
    ``progress("packs", planned and simulated, total)`` is called after every pack."""
    if topo is None or costs is None:
        topo, costs = cp_setup(recipe)
    L = recipe.model.seq_length
    _check_packs(packs, L)
    do_remap = uses_remap(engine, recipe.cp.remap if remap is None else remap)
    do_route = routing and engine == "zeppelin"
    layers = recipe.model.num_layers
    ranks = [RankStats(r) for r in range(topo.num_ranks)]
    results = []
    passes: list[LayerPass] = []
    total = 0.0
    model_flops = 0.0
    pack_sim = _PackSim(engine, topo, costs, layers, do_remap, do_route, hierarchical, baselines, record)
    for k, pack in enumerate(packs):
        result, pack_passes, pack_flops = pack_sim.run(k, pack, ranks)
        passes += pack_passes
        total += result.time_s
        model_flops += pack_flops
        results.append(result)
        report(progress, "packs", k + 1, len(packs))
    gpus = topo.num_ranks * topo.tp
    peak = recipe.hardware_profile.peak_bf16_flops
    mfu = model_flops / (total * gpus * peak) if total > 0 else 0.0
    tokens = L * len(packs)
    return CPSimResult(
        engine,
        recipe.name,
        recipe.hardware,
        topo.num_ranks,
        topo.ranks_per_node,
        layers,
        L,
        do_remap,
        do_route,
        total,
        tokens / total if total > 0 else 0.0,
        mfu,
        results,
        ranks,
        passes,
    )


@dataclass(frozen=True)
class _PackSim:
    """How each pack is planned and simulated: ``layers`` times one decoder layer's passes."""

    engine: str
    topo: CPTopology
    costs: CPCosts
    layers: int
    remap: bool
    routing: bool
    hierarchical: bool
    baselines: bool
    record: bool

    def run(self, k: int, pack: tuple[int, ...], ranks: list[RankStats]) -> tuple[PackResult, list[LayerPass], float]:
        """Plan and simulate pack ``k``, adding its share to ``ranks``; returns its result, its
        recorded layer passes and its model FLOPs."""
        topo, costs, layers = self.topo, self.costs, self.layers
        plan = plan_pack(
            self.engine,
            pack,
            topo,
            costs,
            remap=self.remap,
            routing=self.routing,
            hierarchical=self.hierarchical,
            baselines=self.baselines,
        )
        rmp = plan_remap_for(plan, topo) if self.remap else None
        rtg = plan_routing(plan, topo, costs.kv_bytes) if self.routing else None
        fwd = simulate_pass(plan, topo, costs, backward=False, remap=rmp, routing=rtg, record=self.record)
        bwd = simulate_pass(plan, topo, costs, backward=True, remap=rmp, routing=rtg, record=self.record)
        time_s = layers * (fwd.time_s + bwd.time_s)
        flops = 3 * layers * (sum(pack) * costs.flops_per_token + sum(causal(s) for s in pack) * costs.flops_per_pair)
        _add_rank_stats(ranks, (fwd, bwd), time_s, layers, plan, rmp)
        moved = (rmp.moved_tokens, rmp.inter_node_tokens) if rmp else (0, 0)
        result = PackResult(
            k, len(pack), max(pack), fwd.time_s, bwd.time_s, time_s, plan.digest(), plan.summary(), *moved
        )
        if not self.record:
            return result, [], flops
        passes = [LayerPass(k, "forward", fwd.time_s, fwd.spans), LayerPass(k, "backward", bwd.time_s, bwd.spans)]
        return result, passes, flops


def _check_packs(packs: tuple[tuple[int, ...], ...], seq_length: int) -> None:
    for k, pack in enumerate(packs):
        if sum(pack) != seq_length:
            raise fail(f"packs[{k}]", f"{sum(pack)} tokens", f"exactly model.seq_length={seq_length} tokens per pack")


def _add_rank_stats(
    ranks: list[RankStats],
    passes: tuple[PassResult, PassResult],
    time_s: float,
    layers: int,
    plan: CPPlan,
    rmp: RemapPlan | None,
) -> None:
    """Add one pack's forward and backward layer passes (repeated ``layers`` times) to each rank's totals."""
    attn_tokens = plan.tokens_per_rank()
    lin_tokens = rmp.target_tokens if rmp else attn_tokens
    for r, st in enumerate(ranks):
        busy = 0.0
        for res in passes:
            st.attention_s += layers * res.busy[r].get("attention", 0.0)
            st.linear_s += layers * res.busy[r].get("linear", 0.0)
            busy += sum(res.busy[r].values())
            st.comm_s += layers * res.comm_s[r]
            st.intra_node_bytes += layers * res.sent[r]["intra"]
            st.inter_node_bytes += layers * res.sent[r]["inter"]
        st.idle_s += time_s - layers * busy
        st.attention_tokens += attn_tokens[r]
        st.linear_tokens += lin_tokens[r]

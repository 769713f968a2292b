"""One entry point for every CP engine's placement of a pack."""

from __future__ import annotations

from megatron_slim.plan.cp.baselines import (
    check_heads,
    plan_a2a_p2p,
    plan_allgather,
    plan_dynamic,
    plan_ring,
    plan_ulysses,
)
from megatron_slim.plan.cp.choose import plan_zeppelin
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import ZeppelinLayers
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.recipe_sections import MEGATRON_CP_ENGINE
from megatron_slim.plan.schema import ConfigError, fail

ENGINES = ("zeppelin", "ring", "ulysses", "a2a+p2p", "allgather", "dynamic")


def megatron_cp_refusal(field: str) -> ConfigError:
    """Megatron-LM's own CP, as ``megatron-args`` launches it, has no per-pack placement to simulate."""
    return fail(
        field,
        MEGATRON_CP_ENGINE,
        " | ".join(ENGINES) + " (ring: Transformer Engine's p2p ring, the placement Megatron-LM's own CP gives "
        "packed documents)",
        f"{MEGATRON_CP_ENGINE} (Megatron-LM's own CP) attends each window as one causal sequence split zigzag over "
        "the CP ranks, not per document, so there is no pack to place; `megatron-slim simulate` without "
        "--lengths prices it in the pipeline schedule",
    )


def check_engine(engine: str) -> str:
    if engine == MEGATRON_CP_ENGINE:
        raise megatron_cp_refusal("--cp-engine")
    if engine not in ENGINES:
        raise fail("--cp-engine", engine, " | ".join(ENGINES) + " | all | a comma-separated list")
    return engine


def parse_engines(text: str) -> tuple[str, ...]:
    """``all``, one engine, or a comma-separated list (order kept, duplicates dropped)."""
    if text.strip() == "all":
        return ENGINES
    out: list[str] = []
    for name in (t.strip() for t in text.split(",")):
        if name and check_engine(name) not in out:
            out.append(name)
    if not out:
        raise fail("--cp-engine", text, " | ".join(ENGINES) + " | all")
    return tuple(out)


def check_supported(engine: str, topo: CPTopology, costs: CPCosts) -> None:
    """Raise before any work when ``engine`` cannot run on this model and topology."""
    check_engine(engine)
    if engine == "ulysses" and topo.num_ranks > 1:
        check_heads("ulysses", costs.heads, topo.num_ranks, "parallel.cp")
    if engine == "a2a+p2p" and topo.num_ranks > 1:
        check_heads("a2a+p2p", costs.heads, topo.ranks_per_node, "CP ranks per node")


def uses_remap(engine: str, remap: bool) -> bool:
    """Only Zeppelin has a remapping layer; the baselines run the MLP in their attention layout."""
    return engine == "zeppelin" and remap


def plan_pack(
    engine: str,
    lengths: tuple[int, ...],
    topo: CPTopology,
    costs: CPCosts,
    *,
    remap: bool = True,
    routing: bool = True,
    hierarchical: bool = True,
    baselines: bool = True,
) -> CPPlan:
    """``remap``/``routing``/``hierarchical``/``baselines`` switch Zeppelin's layers (ablations;
    ``baselines``: also consider the other engines' placements); the baselines ignore them."""
    check_engine(engine)
    if engine == "zeppelin":
        return plan_zeppelin(lengths, topo, costs, ZeppelinLayers(remap, routing, hierarchical, baselines))
    if engine == "ring":
        return plan_ring(lengths, topo)
    if engine == "ulysses":
        return plan_ulysses(lengths, topo, costs)
    if engine == "a2a+p2p":
        return plan_a2a_p2p(lengths, topo, costs)
    if engine == "allgather":
        return plan_allgather(lengths, topo)
    return plan_dynamic(lengths, topo)

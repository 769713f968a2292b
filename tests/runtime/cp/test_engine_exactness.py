"""The CP attention engine on 4 gloo ranks (2 nodes x 2) equals one rank's varlen causal attention
over the whole pack, in the output and in dQ/dK/dV, for every group kind and with routing on/off.

Tolerances (elementwise |got - want| <= atol + rtol * |want|, against a float64 reference):
float64 inputs on the reference kernels: atol 5e-6, rtol 1e-5 (the kernel library keeps the
log-sum-exp in float32 by contract, so float64 runs carry float32 round-off in the softmax
statistics); float32 inputs on torch SDPA: atol 2e-5, rtol 1e-4.
"""

import pytest
import torch

from tests.runtime.cp import _plans, _workers
from tests.runtime.cp.conftest import WORLD, reference

TOLERANCE = {"float64": dict(atol=5e-6, rtol=1e-5), "float32": dict(atol=2e-5, rtol=1e-4)}
DV = {"float64": 6, "float32": _workers.D}


def _check(results, precision: str, name: str) -> None:
    plan, _ = _plans.case(name)
    want = reference(plan.lengths, DV[precision], precision)
    seen = torch.zeros(plan.pack_length, dtype=torch.int)
    for rank in range(WORLD):
        got = results[rank][precision][name]
        idx = got["index"]
        seen[idx] += 1
        for key, ref in zip(("out", "dq", "dk", "dv"), want):
            torch.testing.assert_close(
                got[key].double(),
                ref[idx],
                **TOLERANCE[precision],
                msg=lambda m, where=f"{name} rank {rank} {key}": f"{where}: {m}",
            )
    assert bool((seen == 1).all()), f"{name}: every pack token must live on exactly one rank"


def test_zeppelin_plan_mixes_local_intra_and_inter_node_groups():
    plan = _plans.zeppelin_plan()
    assert _plans.scopes(plan) == {"local", "intra", "inter"}
    assert any(s % (2 * WORLD) for s in plan.lengths)


@pytest.mark.parametrize("name", ["zeppelin-routed", "ring-routed", "relay"])
def test_forced_routing_relays_inter_node_hops(name):
    plan, routing = _plans.case(name)
    routed = [h.route for h in routing.hops if h.route.routed]
    assert routed, "routing must be on for inter-node hops"
    assert any(r.dispatches() for r in routed) and any(r.combines() for r in routed)


@pytest.mark.parametrize("name", _plans.CASES)
def test_engine_matches_single_rank_reference_float64(engine_results, name):
    _check(engine_results, "float64", name)


@pytest.mark.parametrize("name", _workers.FP32_CASES)
def test_engine_matches_single_rank_reference_float32_sdpa(engine_results, name):
    _check(engine_results, "float32", name)


@pytest.mark.parametrize("plain,routed", [("zeppelin", "zeppelin-routed"), ("ring", "ring-routed")])
def test_routing_changes_nothing_but_the_path(engine_results, plain, routed):
    for rank in range(WORLD):
        a, b = engine_results[rank]["float64"][plain], engine_results[rank]["float64"][routed]
        for key in ("out", "dq", "dk", "dv"):
            assert torch.equal(a[key], b[key]), f"rank {rank} {key}"


def test_relay_only_ranks_take_part(engine_results):
    assert all(engine_results[r]["float64"]["relay"]["relay_tasks"] == 1 for r in range(WORLD))


def test_queue_order_is_inter_then_intra_then_local(engine_results):
    program = engine_results[0]["float64"]["zeppelin"]["program"]
    order = [part.split("/")[1].split("(")[0] for part in program.split(": ", 1)[1].split(" -> ")]
    rank_of = {"inter": 0, "intra": 1, "local": 2}
    assert order == sorted(order, key=rank_of.get) and "inter" in order


def test_ranks_disagreeing_on_the_plan_all_fail_loudly(engine_results):
    messages = [engine_results[r]["disagree"] for r in range(WORLD)]
    assert all(m is not None and "disagree" in m for m in messages)

"""Per-layer profiling (``dynmo.profile``) on one rank: times, memory and the solver's costs."""

import statistics

import pytest

from megatron_slim.plan.dynmo.costs import LayerCost
from megatron_slim.plan.dynmo.profile import layer_costs
from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.runtime.spawn import run_ranks
from tests.train import _dynmo_workers
from tests.train._dynmo_workers import FROZEN, PROFILED, ROUNDS

pytestmark = pytest.mark.multi


@pytest.fixture(scope="module")
def profiled():
    return run_ranks(_dynmo_workers.profiling, 1, 11)[0]


def _layer_param_bytes(cfg: ModelConfig) -> int:
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d * h
    return 4 * (h + qkv + h * cfg.num_attention_heads * d + h + 2 * f * h + h * f)


def test_static_bytes_are_the_layer_parameters_gradients_and_adam_moments(profiled):
    cfg = ModelConfig(**PROFILED)
    params = _layer_param_bytes(cfg)
    for p in profiled["rounds"][-1]:
        assert p.parameter_bytes == params
        assert p.gradient_bytes == (0 if p.layer in FROZEN else params)
        # AdamW: two fp32 moments per parameter and a fp32 step count per tensor (6 tensors a layer)
        assert p.optimizer_bytes == 2 * params + 6 * 4


def test_activation_bytes_are_counted_per_layer_and_the_outer_hook_still_sees_them(profiled):
    last = profiled["rounds"][-1]
    total = sum(p.activation_bytes for p in last)
    assert 0 < total <= profiled["outer_bytes"]
    assert total > 0.5 * profiled["outer_bytes"]  # the rest: embedding, output layer, loss
    before = {p.layer: p.activation_bytes for p in profiled["rounds"][ROUNDS - 1]}
    for p in last:
        if p.layer in FROZEN:  # no weight gradient: matmuls save no input for one
            assert p.activation_bytes < before[p.layer]
        else:
            assert p.activation_bytes == before[p.layer]


def test_backward_time_drops_when_layers_freeze(profiled):
    """Per iteration, the frozen layers' backward time over the other layers' (so that load from
    other processes, which slows every layer of an iteration alike, cancels): its median drops from
    about 1 to about 0.6 once they freeze."""

    def ratio(rounds):
        def mean(r, frozen):
            return statistics.mean(p.backward_s for p in r if (p.layer in FROZEN) == frozen)

        return statistics.median(mean(r, True) / mean(r, False) for r in rounds)

    training, frozen = profiled["rounds"][1:ROUNDS], profiled["rounds"][ROUNDS + 1 :]
    assert ratio(frozen) < 0.8 * ratio(training)
    assert all(p.forward_s > 0 and p.backward_s > 0 for r in profiled["rounds"] for p in r)


def test_the_profile_converts_to_the_solvers_layer_costs(profiled):
    whole = profiled["whole_model"]
    costs = layer_costs(whole)
    assert [c for c in costs] == [
        LayerCost(p.forward_s, p.backward_s, float(p.static_bytes), p.activation_bytes) for p in whole
    ]
    assert [p.layer for p in whole] == list(range(ModelConfig(**PROFILED).num_layers))


def test_forwards_without_autograd_are_not_profiled(profiled):
    assert all(p.forward_s == 0 and p.backward_s == 0 and p.activation_bytes == 0 for p in profiled["no_grad"])

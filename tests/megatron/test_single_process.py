"""A whole Llama model built through megatron-core on one gloo rank, checked against an
independent pure-torch implementation: the loss and every parameter gradient.

Tolerance: fp32 on CPU; the two implementations differ only in summation order, so per-token
losses agree to 1e-5 absolute and every gradient tensor to 1e-5 relative (Frobenius norm).
"""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.megatron import _workers
from tests.oracle import llama as ref

SEED = 7
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def result():
    return run_ranks(_workers.single_process, 1, SEED)[0]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_every_gradient_match_pure_torch_llama(result, tied):
    cfg = _workers.tiny_config(untie_embeddings_and_output_weights=not tied)
    run = result["models"][tied]
    ref_losses, ref_grads = ref.loss_and_grads(cfg, run["state"], *_workers.tiny_batch(cfg))

    assert run["losses"].shape == (2, cfg.seq_length)
    torch.testing.assert_close(run["losses"], ref_losses, rtol=0, atol=1e-5)
    assert set(run["grads"]) == set(ref_grads)  # every parameter, under whole-model names
    for name, grad in run["grads"].items():
        assert grad is not None, name
        assert rel_err(grad, ref_grads[name]) < REL_TOL, name


def test_tied_model_has_no_separate_output_weight(result):
    assert "output_layer.weight" not in result["models"][True]["state"]
    assert "output_layer.weight" in result["models"][False]["state"]


def test_reference_comparison_detects_a_wrong_qkv_layout(result):
    """Power check: reading the fused QKV as [all q; all k; all v] (the non-grouped layout) must
    give a clearly different loss, so the match above is not an accident of symmetric weights."""
    cfg = _workers.tiny_config()
    state = dict(result["models"][False]["state"])
    ids, labels = _workers.tiny_batch(cfg)
    good = ref.token_losses(cfg, ref.from_megatron(cfg, state), ids, labels)
    for i in range(cfg.num_layers):
        key = f"decoder.layers.{i}.self_attention.linear_qkv.weight"
        d, hq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
        q, k, v = state[key].split([hq * d, ng * d, ng * d])
        state[key] = ref._qkv_fuse(cfg, q, k, v)
    bad = ref.token_losses(cfg, ref.from_megatron(cfg, state), ids, labels)
    assert (good - bad).abs().max() > 1e-3


def test_layers_and_core_attention_carry_global_numbers(result):
    run = result["models"][False]
    assert run["layer_numbers"] == [1, 2, 3, 4]
    assert run["attention_layer_numbers"] == [1, 2, 3, 4]


def test_megatron_forward_and_backward_step_via_shims_match_direct_call(result):
    """The installed megatron-core's forward_step (3-tuple loss, 1 microbatch) and backward_step,
    reached through compat, give exactly the loss and gradients of calling the model directly."""
    torch.testing.assert_close(result["shim_loss"], result["direct_loss"], rtol=0, atol=0)
    for name, grad in result["direct_grads"].items():
        torch.testing.assert_close(result["shim_grads"][name], grad, rtol=0, atol=0)


def test_forward_mlp_shim_runs_the_mlp_sublayer_with_residual(result):
    assert result["forward_mlp_err"] < 1e-6


def test_core_attention_built_through_build_shim_gets_megatron_keywords(result):
    assert result["built_attention"] == (3, True)


def test_cpu_rng_tracker_is_seeded_per_tp_rank_and_restores_the_default_stream(result):
    draws, plain = result["rng"]["draws"], result["rng"]["plain"]
    (before0, inside0, after0), (before0b, inside0b, after0b) = draws[0]
    ((before1, inside1, after1),) = draws[1]
    # Re-seeding reproduces every stream.
    for a, b in ((before0, before0b), (inside0, inside0b), (after0, after0b)):
        assert torch.equal(a, b)
    # The tensor-parallel stream differs by tp rank; the default (data-parallel) one does not.
    assert not torch.equal(inside0, inside1)
    assert torch.equal(before0, before1) and torch.equal(after0, after1)
    # Forking does not consume the default stream: before/after continue torch.manual_seed(seed).
    assert torch.equal(torch.cat([before0, after0]), plain)

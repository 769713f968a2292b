"""Two gloo ranks: pipeline chunks (pp=2, pp=2 x vpp=2, tied embeddings) and tensor parallelism.

Pipeline chunks are loaded from an unpipelined model's weights with ``load_global_state_dict``
and run stage to stage by hand (send/recv of activations and of their gradients, no schedule).
Each layer's output, the loss and every gradient must equal the unpipelined model's *exactly*:
the same fp32 operations run in the same order. Tensor parallelism changes summation order, so
it is held to 1e-5 (loss, absolute) and 1e-5 relative per gradient against the pure-torch model.
"""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.megatron import _workers
from tests.oracle import llama as ref

SEED = 11
EMBEDDING = "embedding.word_embeddings.weight"


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_workers.two_ranks, 2, SEED)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("pp2", [[range(0, 2)], [range(2, 4)]]),
        ("vpp2", [[range(0, 1), range(2, 3)], [range(1, 2), range(3, 4)]]),
    ],
)
def test_each_chunk_holds_its_global_layers(ranks, case, expected):
    for rank, out in enumerate(ranks):
        c = out[case]
        assert c["expected_layers"] == expected[rank]
        assert c["layer_numbers"] == [[i + 1 for i in layers] for layers in expected[rank]]


@pytest.mark.parametrize(
    "case, roles",
    [
        ("pp2", [[(True, False)], [(False, True)]]),
        ("vpp2", [[(True, False), (False, False)], [(False, False), (False, True)]]),
    ],
)
def test_only_first_stage_embeds_and_only_last_stage_has_the_head(ranks, case, roles):
    assert [out[case]["roles"] for out in ranks] == roles


@pytest.mark.parametrize("case", ["pp2", "vpp2", "pp2_tied"])
def test_stage_by_stage_run_reproduces_unpipelined_model_exactly(ranks, case):
    seen_layers = set()
    for out in ranks:
        c = out[case]
        for layer, hidden in c["layer_out"].items():
            assert torch.equal(hidden, c["ref"]["layer_out"][layer]), (case, layer)
            seen_layers.add(layer)
        if c["losses"] is not None:
            assert torch.equal(c["losses"], c["ref"]["losses"])
    assert seen_layers == {0, 1, 2, 3}
    assert sum(out[case]["losses"] is not None for out in ranks) == 1


@pytest.mark.parametrize("case", ["pp2", "vpp2"])
def test_every_gradient_equals_unpipelined_gradient_by_global_name(ranks, case):
    names = []
    for out in ranks:
        c = out[case]
        for grads in c["grads"]:
            for name, grad in grads.items():
                assert torch.equal(grad, c["ref"]["grads"][name]), (case, name)
                names.append(name)
    assert sorted(names) == sorted(ranks[0][case]["ref"]["grads"])  # each parameter exactly once


def test_load_global_state_dict_replaced_the_chunks_own_initialisation(ranks):
    c = ranks[0]["pp2"]  # chunks built with seed+1, loaded from the seed model
    differs = [
        not torch.equal(t, c["ref"]["state"][n]) for n, t in c["init_state"][0].items() if not n.endswith("norm.weight")
    ]
    assert all(differs)


def test_same_seed_initialises_chunks_like_the_whole_model(ranks):
    for out in ranks:
        c = out["pp2_tied"]  # chunks and reference built with the same seed
        for state in c["init_state"]:
            for name, tensor in state.items():
                assert torch.equal(tensor, c["ref"]["state"][name]), name


def test_tied_embedding_copies_share_a_name_and_their_grads_sum_to_the_whole_models(ranks):
    first, last = ranks[0]["pp2_tied"], ranks[1]["pp2_tied"]
    assert EMBEDDING in first["grads"][0] and EMBEDDING in last["grads"][0]
    assert "output_layer.weight" not in last["grads"][0]
    total = first["grads"][0][EMBEDDING] + last["grads"][0][EMBEDDING]
    torch.testing.assert_close(total, first["ref"]["grads"][EMBEDDING], rtol=1e-6, atol=1e-9)


def test_parallel_state_sizes_and_ranks(ranks):
    for rank, out in enumerate(ranks):
        sizes = out["sizes"]
        assert sizes[(("tp", 2),)] == {"tp": (2, rank), "pp": (1, 0), "cp": (1, 0), "dp": (1, 0)}
        assert sizes[(("pp", 2),)] == {"tp": (1, 0), "pp": (2, rank), "cp": (1, 0), "dp": (1, 0)}
        assert sizes[(("cp", 2),)] == {"tp": (1, 0), "pp": (1, 0), "cp": (2, rank), "dp": (1, 0)}
        assert sizes[()] == {"tp": (1, 0), "pp": (1, 0), "cp": (1, 0), "dp": (2, rank)}


def _expected_tp_shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Megatron's TP layout, written out by hand: norms replicated; row-parallel projections split
    their input dim; fused SwiGLU fc1 holds [gate_r; up_r]; everything else splits rows."""
    if name.endswith("norm.weight"):
        return full
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[rank]
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    return full.chunk(tp, dim=0)[rank]


def test_tensor_parallel_shards_loss_and_grads_match_pure_torch_llama(ranks):
    cfg = _workers.tiny_config()
    ref_losses, ref_grads = ref.loss_and_grads(cfg, ranks[0]["tp2"]["full_state"], *_workers.tiny_batch(cfg))
    for out in ranks:
        tp = out["tp2"]
        rank, size = tp["tp_rank"], tp["tp_size"]
        assert size == 2
        for name, shard in tp["state"].items():
            assert torch.equal(shard, _expected_tp_shard(name, tp["full_state"][name], rank, size)), name
        torch.testing.assert_close(tp["losses"], ref_losses, rtol=0, atol=1e-5)
        for name, grad in tp["grads"].items():
            expected = _expected_tp_shard(name, ref_grads[name], rank, size)
            assert ((grad - expected).norm() / expected.norm()).item() < 1e-5, name

"""``schedule.vocab_parallel``: the cost model spreads the embedding and output layer over every
pipeline rank (``plan/cost/vocab.py``), checked against hand arithmetic."""

import pytest

from megatron_slim.commands.simulate import run_one
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

# llama2-7b: h 4096, vocab 32000; tp4 with SP, pp4, bf16; dp1 puts pp ranks 0 and 3 on two nodes
BASE = ["parallel.dp=1", "train.global_batch_size=8"]
H, V, TP, PP, E, T = 4096, 32000, 4, 4, 2, 8192
GEMM_RATE, MEMORY_RATE = 989.4e12 * 0.70, 3.35e12 * 0.80  # h100 profile's spec sheet x efficiency
NIC_BW, NIC_LATENCY = 50.0e9, 8.0e-6


def _models(*sets: str) -> tuple[CostModel, CostModel]:
    off = CostModel(load_recipe("llama2-7b-64k", [*BASE, *sets]))
    on = CostModel(load_recipe("llama2-7b-64k", [*BASE, *sets, "schedule.vocab_parallel=true"]))
    return off, on


def _collective(nbytes: float) -> float:
    return 2 * (PP - 1) / PP * nbytes / NIC_BW + 2 * (PP - 1) * NIC_LATENCY


def _hand_terms() -> dict[str, float]:
    hidden_bytes = T * H * E / TP  # one slice's hidden states per GPU (sequence parallel)
    embedding = 2 * T * H * E / TP / PP / MEMORY_RATE
    output = 2 * T * H * (V / TP) / PP / GEMM_RATE + (3 * T * V / TP * 4 + 2 * T * H * E) / PP / MEMORY_RATE
    return {
        "embedding": embedding,
        "output": output,
        "embedding_comm": _collective(T * 8) + _collective(hidden_bytes),
        "output_comm": _collective(hidden_bytes) + _collective(3 * T * 4),
    }


def test_every_stage_carries_a_share_of_both_when_each_rank_holds_one_chunk():
    off, on = _models()
    hand = _hand_terms()
    layers_f, layers_b = off.forward_time(1, T, 0), off.backward_time(1, T, 0)  # a middle stage: layers only
    fwd = hand["embedding"] + hand["output"] + hand["embedding_comm"] + hand["output_comm"]
    bwd = 2 * (hand["embedding"] + hand["output"]) + hand["embedding_comm"] + hand["output_comm"]
    for stage in range(PP):
        assert on.forward_time(stage, T, 0) - layers_f == pytest.approx(fwd, rel=1e-9)
        assert on.backward_time(stage, T, 0) - layers_b == pytest.approx(bwd, rel=1e-9)
    # without the option the whole output layer sits on the last stage: p times one share, no collectives
    assert off.forward_time(PP - 1, T, 0) - layers_f == pytest.approx(PP * hand["output"], rel=1e-9)


def test_with_interleaving_the_embedding_goes_to_first_chunks_and_the_output_to_last_chunks():
    off, on = _models("parallel.vpp=2")
    hand = _hand_terms()
    layers = off.forward_time(1, T, 0)
    for stage in range(PP):  # chunk 0 of every rank
        assert on.forward_time(stage, T, 0) - layers == pytest.approx(hand["embedding"] + hand["embedding_comm"])
    for stage in range(PP, 2 * PP):  # chunk 1 of every rank
        assert on.forward_time(stage, T, 0) - layers == pytest.approx(hand["output"] + hand["output_comm"])


def test_output_activations_and_weights_are_split_over_the_pipeline_ranks():
    off, on = _models()
    output_activations = (T * H * E * 2 / TP + T * V / TP * 4) / PP  # norm/output inputs + fp32 softmax
    for stage in range(PP):
        assert on.activation_bytes(stage, T) - off.activation_bytes(1, T) == pytest.approx(output_activations)
    layers = off.rank_params(1)
    for rank in range(PP):  # vocabulary sharded over TP x PP; the final norm replicated
        assert on.rank_params(rank) == pytest.approx(layers + 2 * V * H / TP / PP + H)
    assert off.rank_params(0) == pytest.approx(layers + V * H / TP)
    assert off.rank_params(PP - 1) == pytest.approx(layers + V * H / TP + H)


def test_one_pipeline_rank_is_unchanged():
    off, on = _models("parallel.pp=1")
    assert on.forward_time(0, T, 0) == off.forward_time(0, T, 0)
    assert on.backward_time(0, T, 0) == off.backward_time(0, T, 0)
    assert on.activation_bytes(0, T) == off.activation_bytes(0, T)
    assert on.rank_params(0) == off.rank_params(0)


def test_simulation_lowers_the_bubble_and_the_last_ranks_peak():
    sets = ["parallel.pp=4", "parallel.vpp=2", "schedule.num_slices=4", "model.seq_length=32768"]
    recipes = [load_recipe("llama2-7b-64k", [*BASE, *sets, f"schedule.vocab_parallel={v}"]) for v in ("false", "true")]
    off, on = (run_one(r) for r in recipes)
    assert on.result.bubble_ratio < off.result.bubble_ratio
    last_off, last_on = off.result.ranks[-1], on.result.ranks[-1]
    assert last_on.peak_memory_bytes < last_off.peak_memory_bytes
    assert last_on.static_bytes < last_off.static_bytes
    assert on.label.endswith("vocab-pp") and not off.label.endswith("vocab-pp")


def test_the_recipe_field_takes_only_booleans():
    with pytest.raises(ConfigError, match="schedule.vocab_parallel"):
        load_recipe("llama2-7b-64k", ["schedule.vocab_parallel=maybe"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_carries_a_vocab_over_pp_times_tp_share_of_the_output_layer(tp):
    # megatron-slim train runs the exchange over each TP rank's vocabulary shard (docs/vocab-parallel.md)
    sp = f"parallel.sequence_parallel={str(tp > 1).lower()}"
    cost = CostModel(load_recipe("llama2-7b-64k", [*BASE, f"parallel.tp={tp}", sp, "schedule.vocab_parallel=true"]))
    work = cost.shape.output_forward_work(T).scale(cost.vocab.share)
    assert work.gemm_flops == pytest.approx(2 * T * H * V / (PP * tp))
    for rank in range(PP):
        assert cost.vocab.rank_params(rank) == pytest.approx(2 * V * H / (PP * tp) + H)

"""Pure helpers of the model builder: stage assignment, roles, TP sharding, init, validation."""

import pytest
import torch

from megatron_slim.megatron.model import weights
from megatron_slim.megatron.model.gpt import chunk_roles, split_layers, stage_layers, transformer_config
from megatron_slim.megatron.model.parallel import _check_sizes
from megatron_slim.megatron.model.rotary import zigzag_positions
from tests.megatron._workers import tiny_config


@pytest.mark.parametrize(
    "num_layers, pp, vpp",
    [
        (4, 1, 1),
        (4, 2, 1),
        (4, 2, 2),
        (8, 2, 2),
        (6, 3, 1),
        (12, 3, 2),
        (8, 4, 2),
        (5, 5, 1),
        (9, 1, 3),
    ],
)
def test_stage_layers_is_megatrons_interleaved_assignment(num_layers, pp, vpp):
    result = stage_layers(num_layers, pp, vpp)
    per_stage = num_layers // (pp * vpp)
    assert len(result) == pp and all(len(chunks) == vpp for chunks in result)
    for rank in range(pp):
        for chunk in range(vpp):
            stage = chunk * pp + rank
            assert result[rank][chunk] == range(stage * per_stage, (stage + 1) * per_stage)
    covered = sorted(i for chunks in result for layers in chunks for i in layers)
    assert covered == list(range(num_layers))  # a partition of all layers


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 3, 1), "num_layers=4"),
        ((4, 2, 3), "num_layers=4"),
        ((4, 0, 1), "pp=0"),
        ((4, 1, 0), "vpp=0"),
    ],
)
def test_stage_layers_rejects_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        stage_layers(*args)


def test_split_layers_gives_consecutive_ranges_of_the_given_sizes():
    assert split_layers(8, (1, 5, 2)) == [[range(0, 1)], [range(1, 6)], [range(6, 8)]]
    for bad in ((4, 3), (8, 0), ()):
        with pytest.raises(ValueError, match="allowed values are counts >= 1 summing to 8"):
            split_layers(8, bad)


def test_chunk_roles():
    assert [chunk_roles(r, c, 2, 2) for r in range(2) for c in range(2)] == [
        (True, False),
        (False, False),
        (False, False),
        (False, True),
    ]
    assert chunk_roles(0, 0, 1, 1) == (True, True)


@pytest.mark.parametrize(
    "sizes, match",
    [
        (dict(tp=3), "divide"),
        (dict(pp=2, tp=2, cp=2), "divide"),
        (dict(vpp=2), "vpp=2"),
        (dict(dp=3), "dp=3"),
        (dict(cp=0), "cp=0"),
    ],
)
def test_parallel_sizes_are_validated(sizes, match):
    full = dict(tp=1, pp=1, cp=1, vpp=1, dp=None)
    full.update(sizes)
    with pytest.raises(ValueError, match=match):
        _check_sizes(4, **full)


def test_transformer_config_is_llama_shaped_and_rejects_unknown_overrides():
    cfg = transformer_config(tiny_config(), tp=2)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.num_query_groups == 2 and cfg.kv_channels == 16 and cfg.tensor_model_parallel_size == 2
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    with pytest.raises(ValueError, match="no_such_field"):
        transformer_config(tiny_config(), no_such_field=1)


def _param(shape, dim=None, stride=1):
    p = torch.nn.Parameter(torch.empty(shape))
    if dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


def test_tp_shard_follows_partition_dim_and_stride():
    full = torch.arange(8.0).repeat(2, 1).T  # [8, 2], rows 0..7
    rows = lambda t: t[:, 0].tolist()  # noqa: E731
    assert rows(weights.tp_shard(full, _param((4, 2), 0), 1, 2)) == [4, 5, 6, 7]
    # stride 2 (fused [gate; up]): rank r holds [gate_r; up_r]
    assert rows(weights.tp_shard(full, _param((4, 2), 0, 2), 0, 2)) == [0, 1, 4, 5]
    assert rows(weights.tp_shard(full, _param((4, 2), 0, 2), 1, 2)) == [2, 3, 6, 7]
    assert weights.tp_shard(full.T, _param((2, 4), 1), 0, 2).shape == (2, 4)
    assert weights.tp_shard(full, _param((8, 2)), 1, 2) is full  # replicated
    assert weights.full_shape(_param((4, 2), 0), 2) == (8, 2)


def test_init_depends_only_on_seed_and_name():
    a = weights.init_full_tensor("decoder.layers.3.mlp.linear_fc1.weight", (6, 4), seed=1, num_layers=4)
    b = weights.init_full_tensor("decoder.layers.3.mlp.linear_fc1.weight", (6, 4), seed=1, num_layers=4)
    c = weights.init_full_tensor("decoder.layers.2.mlp.linear_fc1.weight", (6, 4), seed=1, num_layers=4)
    d = weights.init_full_tensor("decoder.layers.3.mlp.linear_fc1.weight", (6, 4), seed=2, num_layers=4)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    assert torch.equal(
        weights.init_full_tensor("decoder.final_layernorm.weight", (4,), seed=1, num_layers=4), torch.ones(4)
    )


def test_residual_output_projections_get_scaled_init():
    big = dict(seed=0, num_layers=8, std=0.02)
    fc1 = weights.init_full_tensor("decoder.layers.0.mlp.linear_fc1.weight", (256, 256), **big)
    fc2 = weights.init_full_tensor("decoder.layers.0.mlp.linear_fc2.weight", (256, 256), **big)
    assert fc1.std().item() == pytest.approx(0.02, rel=0.05)
    assert fc2.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2 * 8)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_positions_partition_the_sequence(cp):
    seq = 16
    parts = [zigzag_positions(seq, r, cp) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    chunk = seq // (2 * cp)
    assert parts[0][:chunk].tolist() == list(range(chunk))
    assert parts[0][chunk:].tolist() == list(range(seq - chunk, seq))


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_cpu_rotary_table_is_rotate_half_rope_and_splits_zigzag_for_cp():
    from megatron_slim.megatron.model.rotary import make_cpu_rotary_embedding

    rope = make_cpu_rotary_embedding(
        kv_channels=8, rotary_percent=1.0, rotary_base=500, use_cpu_initialization=True, cp_group=None
    )
    table = rope(16)
    inv_freq = 1.0 / (500 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    angles = torch.outer(torch.arange(16, dtype=torch.float32), inv_freq)
    assert table.shape == (16, 1, 1, 8) and table.device.type == "cpu"
    torch.testing.assert_close(table[:, 0, 0], torch.cat([angles, angles], dim=-1), rtol=0, atol=0)
    split = rope(16, cp_group=FakeGroup(rank=1, size=2))
    assert torch.equal(split, table[zigzag_positions(16, 1, 2)])

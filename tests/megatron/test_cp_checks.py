"""Start-up checks for ``--cp-engine`` on a parsed Megatron namespace, and where a pack's sequence
lengths come from (the launcher end to end runs in tests/real_megatron against Megatron-LM itself)."""

import torch

from tests.oracle.models import TINY_CP_MEGATRON_ARGS

GOOD = {**TINY_CP_MEGATRON_ARGS, "cp_comm_type": ["p2p"]}
REJECTED = [
    (dict(micro_batch_size=2), "--micro-batch-size 1"),
    (
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        "--virtual-pipeline-model-parallel-size 1",
    ),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), "drop --sequence-parallel"),
    (dict(cuda_graph_impl="local"), "--cuda-graph-impl none"),
    (dict(hybrid_context_parallel=True), "drop --hybrid-context-parallel"),
    (dict(cp_comm_type=["a2a"]), "drop --cp-comm-type"),
    (dict(num_experts=8), "drop --num-experts"),
    (dict(mtp_num_layers=1), "drop --mtp-num-layers"),
    (dict(position_embedding_type="yarn"), "got yarn"),
    (dict(attention_dropout=0.1), "--attention-dropout 0"),
    (dict(reset_attention_mask=False), "--reset-position-ids and --reset-attention-mask together"),
    (dict(cp_engine="ulysses", context_parallel_size=8), "ulysses"),
]


def test_cp_engine_flag_combinations_are_checked_before_any_model():
    import argparse
    import re

    import pytest

    from megatron_slim.megatron.launch.cp_checks import check_cp_args
    from megatron_slim.plan.schema import ConfigError

    check_cp_args(argparse.Namespace(**GOOD))
    check_cp_args(argparse.Namespace(**{**GOOD, "cp_engine": "te", "micro_batch_size": 4}))  # not ours to check
    for change, needle in REJECTED:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            check_cp_args(argparse.Namespace(**{**GOOD, **change}))


def test_pack_lengths_come_from_cu_seqlens_then_position_resets_then_the_row():
    import pytest

    from megatron_slim.megatron.cp.lengths import document_lengths, pack_lengths

    tokens = torch.zeros(1, 16, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]])
    cu = torch.tensor([[0, 3, 3, 10, 16, -1, -1]], dtype=torch.int32)  # an empty sequence and padding
    assert pack_lengths({"tokens": tokens, "position_ids": positions, "cu_seqlens": cu}) == ((3, 7, 6), "cu_seqlens")
    by_positions = pack_lengths({"tokens": tokens, "position_ids": positions, "cu_seqlens": None})
    assert by_positions == ((3, 5, 8), "position_ids")
    assert pack_lengths({"tokens": tokens, "position_ids": None}) == ((16,), "row")
    assert document_lengths(torch.tensor([5, 1, 9, 9, 1, 4]), eod=1) == (2, 3, 1)
    with pytest.raises(ValueError, match="ends at 10 tokens, the pack holds 16"):
        pack_lengths({"tokens": tokens, "cu_seqlens": torch.tensor([0, 4, 10])})
    with pytest.raises(ValueError, match="micro-batch-size 1"):
        pack_lengths({"tokens": torch.zeros(2, 16), "position_ids": None})

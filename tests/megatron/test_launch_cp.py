"""`python -m megatron_slim.launch pretrain_gpt.py --context-parallel-size 2 --cp-engine zeppelin --cp-remap`
against the stand-in of Megatron-LM (tests/megatron/standin): the hooks install the CP attention and
the remap layer, plan every microbatch inside ``get_batch_on_this_cp_rank`` (document lengths from the
``--reset-position-ids`` positions), and megatron-core's own no-pipelining schedule and
``forward_step_calc_loss`` -- with the CP-wide loss normalisation the hooks add -- give the first
step's gradients of the single-process reference (every document on its own, mean over each
microbatch's tokens, averaged over microbatches); the loss falls."""
import os
import sys

import torch
import torch.distributed as dist

from megatron_slim.runtime.spawn import run_ranks

STANDIN = os.path.join(os.path.dirname(__file__), "standin")
TOL = dict(atol=2e-5, rtol=1e-4)
MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
             vocab_size=128, seq_length=64)
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings",
         "64", "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--lr", "0.5", "--reset-position-ids", "--reset-attention-mask",
         "--context-parallel-size", "2", "--cp-engine", "zeppelin", "--cp-remap", "--slimpipe-hardware", "cpu"]


def _reference(rank, world_size, initial_state):
    """First-step gradients of the unsharded model on the stand-in's microbatches."""
    import importlib

    from megatron_slim.megatron.model import build_chunk, global_grads
    from megatron_slim.megatron.parallel import ParallelGroups
    from megatron_slim.plan.recipe import ModelConfig

    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    if rank != 0:
        return None
    script = importlib.import_module("pretrain_gpt")  # the stand-in script's functions (no __main__ run)
    cfg = ModelConfig(**MODEL)
    model = build_chunk(cfg, ParallelGroups(*([solo] * 7), embd=solo, pos_embd=solo), layers=range(cfg.num_layers),
                        pre_process=True, post_process=True)
    missing, unexpected = model.load_state_dict(initial_state, strict=False)
    assert not [k for k in missing + unexpected if "_extra_state" not in k], (missing, unexpected)
    batches = list(script.train_valid_test_datasets_provider()(0))
    starts = script.document_starts(cfg.seq_length) + [cfg.seq_length]
    total = 0.0
    for batch in batches:
        pack = 0.0
        for start, end in zip(starts, starts[1:]):
            losses = model(batch["tokens"][:, start:end], torch.arange(end - start).unsqueeze(0), None,
                           labels=batch["labels"][:, start:end])
            pack = pack + (losses * batch["loss_mask"][:, start:end]).sum()
        total = total + pack / batch["loss_mask"].sum() / len(batches)
    total.backward()
    return {name: g for name, g in global_grads(model).items() if g is not None}


def launch_cp(rank, world_size, flags):
    sys.path.insert(0, STANDIN)
    from megatron_slim import launch as launcher

    launcher.main([os.path.join(STANDIN, "pretrain_gpt.py"), *flags])
    from megatron.core import utils as core_utils
    from megatron.training import training

    from megatron_slim.megatron.cp_attention import CPCoreAttention
    from megatron_slim.megatron.remap_layer import RemapTransformerLayer

    run = training.LAST_RUN
    state = core_utils.get_batch_on_this_cp_rank.cp_state
    modules = [m for chunk in run["model"] for m in chunk.modules()]
    return {"losses": run["losses"], "plans_set": state.plans_set, "sources": dict(state.length_sources),
            "replanned": state.replanned, "tokens": state.context.plan.tokens_per_rank(),
            "cp_attentions": sum(isinstance(m, CPCoreAttention) for m in modules),
            "remap_layers": sum(isinstance(m, RemapTransformerLayer) for m in modules),
            "remap_set": state.context.remap is not None, "functions": run["functions"],
            "grads": run["first_grads"] if rank == 0 else None,
            "reference": _reference(rank, world_size, run["initial_state"])}


def test_launcher_runs_zeppelin_cp_with_remap_and_reference_gradients():
    results = run_ranks(launch_cp, 2, FLAGS, timeout_s=300)
    for r in results:
        assert r["cp_attentions"] == 2 and r["remap_layers"] == 2 and r["remap_set"]
        assert r["plans_set"] == 4 * 2 and r["sources"] == {"position_ids": 8} and r["replanned"] == 0
        assert r["functions"] == ["forward_backward_no_pipelining"] * 4  # megatron-core's own schedule, wrapped
        assert len(r["losses"]) == 4 and r["losses"][-1] < r["losses"][0]
    assert results[0]["losses"] == results[1]["losses"]
    assert len(set(results[0]["tokens"])) > 1  # uneven tokens per rank: the CP-wide normalisation matters
    grads, reference = results[0]["grads"], results[0]["reference"]
    assert grads.keys() == reference.keys()
    for name, want in reference.items():
        torch.testing.assert_close(grads[name], want, **TOL, msg=lambda m, name=name: f"{name}: {m}")


GOOD = dict(cp_engine="zeppelin", cp_remap=False, context_parallel_size=2, use_slimpipe=False, micro_batch_size=1,
            pipeline_model_parallel_size=1, tensor_model_parallel_size=1, sequence_parallel=False,
            position_embedding_type="rope", attention_dropout=0.0, reset_position_ids=True,
            reset_attention_mask=True, cp_comm_type=["p2p"], num_layers=2, hidden_size=64, ffn_hidden_size=160,
            num_attention_heads=4, num_query_groups=2, group_query_attention=True, seq_length=64,
            padded_vocab_size=128, data_parallel_size=1, global_batch_size=2, slimpipe_hardware="cpu",
            slimpipe_num_slices=1, slimpipe_slice_policy="uniform", rotary_base=10000.0)
REJECTED = [
    (dict(micro_batch_size=2), "--micro-batch-size 1"),
    (dict(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size 1"),
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

    from megatron_slim.megatron.cp_checks import check_cp_args
    from megatron_slim.plan.schema import ConfigError

    check_cp_args(argparse.Namespace(**GOOD))
    check_cp_args(argparse.Namespace(**{**GOOD, "cp_engine": "te", "micro_batch_size": 4}))  # not ours to check
    for change, needle in REJECTED:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            check_cp_args(argparse.Namespace(**{**GOOD, **change}))


def test_pack_lengths_come_from_cu_seqlens_then_position_resets_then_the_row():
    import pytest

    from megatron_slim.megatron.cp_lengths import document_lengths, pack_lengths

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

"""Rank function of the vocabulary-parallel exactness test (module level so spawn can import it)."""

import dataclasses
import functools

import torch

from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.train.microbatch import vocab_forward_step
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_4L
from tests.runtime.pipeline._workers import make_batches


def run_vocab_parallel(rank, world_size, configs, seed=1234):
    """Each config: (tied, kind, num_microbatches, slice_lengths[, vpp]). Returns per config
    (reports, grads of every parameter this rank's optimizer steps, reference on rank 0); a
    forward-only call after the step must report the same losses."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.vocab_head import build_vocab_head
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    results = []
    for tied, kind, m, lengths, *vpp in configs:
        model = ModelConfig(**{**TINY_GQA_4L, "untie_embeddings_and_output_weights": not tied})
        batches = make_batches(model, m, micro_batch=2, seed=seed + m)
        chunk_groups = dataclasses.replace(groups, vpp=vpp[0] if vpp else 1)
        chunks = build_rank_chunks(model, chunk_groups, core_attention=SliceCoreAttention, seed=seed)
        head = build_vocab_head(chunks, groups)
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), kind=kind), vocab_head=head)
        step = functools.partial(
            fb,
            forward_step_func=vocab_forward_step,
            model=chunks,
            num_microbatches=m,
            seq_length=model.seq_length,
            micro_batch_size=2,
        )
        reports = step(data_iterator=[iter(batches) for _ in chunks])
        head.reduce_grads()
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        evaluated = step(data_iterator=[iter(batches) for _ in chunks], forward_only=True)
        ref = reference.unsliced_step(model, dataclasses.replace(groups), batches, seed) if rank == 0 else None
        reports = [r["lm loss"] for r in reports]
        assert len(evaluated) == len(reports)
        for got, want in zip(evaluated, reports):  # the forward-only call reports the step's losses
            torch.testing.assert_close(got["lm loss"], want)
        lookup = head.lookup_head
        shapes = (head.owned, tuple(head.weight.shape), lookup.owned, tuple(lookup.weight.shape))
        results.append((reports, grads, ref, shapes))
    return results

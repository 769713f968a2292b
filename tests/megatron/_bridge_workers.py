"""Rank function for the Megatron-Bridge step test (module level so spawn can import it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.megatron import _bridge_like
from tests.oracle import reference

NUM_MICROBATCHES = 2


def _batches(provider, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, provider.vocab_size, (2, provider.seq_length + 1), generator=g)
        mask = (torch.rand(2, provider.seq_length, generator=g) > 0.2).float()
        pos = torch.arange(provider.seq_length).expand(2, -1).contiguous()
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": mask,
                "position_ids": pos,
                "attention_mask": None,
            }
        )
    return out


def _build_model(provider, groups):
    """What Bridge's ``GPTModelProvider.provide`` builds from the provider's layer spec."""
    from megatron.core.models.gpt import GPTModel

    from megatron_slim.megatron import compat
    from megatron_slim.megatron.model.rotary import make_cpu_rotary_embedding

    model = GPTModel(
        config=provider,
        transformer_layer_spec=provider.layer_spec(vp_stage=None),
        vocab_size=provider.vocab_size,
        max_sequence_length=provider.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=provider.rotary_base,
        **compat.model_groups_kwargs(GPTModel, groups),
    )
    model.rotary_pos_emb = make_cpu_rotary_embedding(  # megatron-core's table moves itself to CUDA
        kv_channels=provider.kv_channels,
        rotary_percent=1.0,
        rotary_base=provider.rotary_base,
        use_cpu_initialization=True,
        cp_group=groups.cp,
    )
    return model


def _reference(model, batches, state) -> tuple[list, dict]:
    """Unsliced: each microbatch through the whole model, Megatron's per-microbatch normalisation."""

    def run(batch):
        output, loss_func = _bridge_like.forward_step(state, iter([batch]), model)
        return loss_func(output)

    reports = reference.microbatch_mean_step(run, batches)
    return reports, {name: p.grad.clone() for name, p in model.named_parameters()}


def bridge_step(rank, world_size, num_slices, seed=5):
    """install() on a Bridge-shaped config, then one step the way Bridge's ``train_step`` runs it:
    the function from ``get_forward_backward_func`` bound by name after install, called with
    train.py's keywords. Returns (reports, grads, reference reports, reference grads, facts)."""
    from megatron_slim.megatron import bridge
    from megatron_slim.megatron.model.parallel import model_parallel
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    config = _bridge_like.config_container()
    handle = bridge.install(config, num_slices=num_slices)
    with model_parallel(seed=seed) as groups:
        # bound by name after install, as Bridge's train.py imports it (0.6.2 train.py:41-44)
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        forward_backward_func = get_forward_backward_func(pp_size=1, vp_size=None)
        model = _build_model(config.model, groups)  # weights: megatron-core's seeded init
        state = SimpleNamespace(cp_group=groups.cp)
        batches = _batches(config.model, seed)
        reports = forward_backward_func(
            forward_step_func=lambda it, m, return_schedule_plan=False: _bridge_like.forward_step(state, it, m),
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=NUM_MICROBATCHES,
            seq_length=config.model.seq_length,
            micro_batch_size=2,
            decoder_seq_length=config.model.seq_length,
            forward_only=False,
            adjust_tensor_shapes_fn=None,
            p2p_communicator=None,
            pg_collection=_pg_collection(groups),
        )
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ref_reports, ref_grads = _reference(model, batches, state)
        facts = {
            "is_slimpipe": forward_backward_func is handle.forward_backward_func,
            "slice_attention_layers": sum(isinstance(m, SliceCoreAttention) for m in model.modules()),
            "slice_lengths": handle.forward_backward_func.settings.slice_lengths,
        }
    handle.remove()
    return [r["lm loss"] for r in reports], grads, ref_reports, ref_grads, facts


def _pg_collection(groups):
    """Megatron-core's ``ProcessGroupCollection`` (what Bridge passes as ``pg_collection``)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_slim.megatron import compat

    return compat.model_groups_kwargs(GPTModel, groups)["pg_collection"]

"""Rank function for the real-Bridge step test (module level so spawn can import it)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from tests.oracle import reference
from tests.oracle.models import NARROW_GQA_2L
from tests.real_bridge import _stand_ins

TINY = {k: v for k, v in NARROW_GQA_2L.items() if k != "rotary_base"}  # the provider's own default


def real_provider():
    """Bridge's own ``GPTModelProvider`` with Bridge's own local (non-TE) layer spec, on CPU."""
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec

    return GPTModelProvider(
        **TINY,
        kv_channels=8,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="rope",
        transformer_layer_spec=local_layer_spec,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        share_embeddings_and_output_weights=False,
        make_vocab_size_divisible_by=1,
    )


def config_container(provider):
    from megatron.bridge.training.config import RerunStateMachineConfig, TrainingConfig

    return SimpleNamespace(
        model=provider,
        train=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=1),
        dataset=SimpleNamespace(dataloader_type="single", skip_getting_attention_mask_from_dataset=True),
        rerun_state_machine=RerunStateMachineConfig(),
    )


class _NoTimer:
    """Bridge's timers and straggler timer (``state.timers(name)``, ``with state.straggler_timer``,
    ``with state.straggler_timer(bdata=True)``): timing only, nothing to record here."""

    def __call__(self, *args, **kwargs):
        return self

    def start(self, *args, **kwargs):
        pass

    def stop(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _state(config):
    return SimpleNamespace(cfg=config, timers=_NoTimer(), straggler_timer=_NoTimer())


def _batches(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, TINY["vocab_size"], (2, TINY["seq_length"] + 1), generator=g)
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": (torch.rand(2, TINY["seq_length"], generator=g) > 0.2).float(),
                "position_ids": torch.arange(TINY["seq_length"]).expand(2, -1).contiguous(),
            }
        )
    return out


def _unsliced(step, model, batch):
    output, loss_func = step(iter([batch]), model)
    return loss_func(output)


def real_bridge_step(rank, world_size, num_slices, seed=3):
    """``install`` on Bridge's own provider; the model from ``provider.provide()``; one step through
    the function Bridge's ``train`` module calls, with Bridge's ``gpt_step.forward_step`` (its
    ``get_batch``, ``get_batch_on_this_cp_rank``, ``masked_next_token_loss``); then the same batches
    through the unsliced model with the same forward step."""
    _stand_ins.install()
    torch.Tensor.cuda = lambda self, *a, **k: self  # this rank runs on CPU: get_batch_from_iterator's .cuda()
    from megatron.bridge.training import gpt_step, train

    from megatron_slim.megatron import bridge, compat
    from megatron_slim.megatron.model.parallel import model_parallel
    from megatron_slim.megatron.model.rotary import make_cpu_rotary_embedding
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    config = config_container(real_provider())
    handle = bridge.install(config, num_slices=num_slices)
    with model_parallel(seed=seed) as groups:
        from megatron.core.models.gpt import GPTModel

        pg = compat.model_groups_kwargs(GPTModel, groups)["pg_collection"]
        config.model._pg_collection = pg
        config.model.finalize()  # Bridge's TransformerConfig defers __post_init__ (ConfigContainer.validate calls it)
        model = config.model.provide()
        model.rotary_pos_emb = make_cpu_rotary_embedding(  # megatron-core's table moves itself to CUDA
            kv_channels=8,
            rotary_percent=1.0,
            rotary_base=config.model.rotary_base,
            use_cpu_initialization=True,
            cp_group=groups.cp,
        )
        step = functools.partial(gpt_step.forward_step, _state(config))
        forward_backward_func = train.get_forward_backward_func(pp_size=1, vp_size=None)
        batches = _batches(seed)
        reports = forward_backward_func(
            forward_step_func=step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=2,
            seq_length=TINY["seq_length"],
            micro_batch_size=2,
            decoder_seq_length=TINY["seq_length"],
            forward_only=False,
            adjust_tensor_shapes_fn=None,
            p2p_communicator=None,
            pg_collection=pg,
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        ref_reports = reference.microbatch_mean_step(functools.partial(_unsliced, step, model), batches)
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        facts = {
            "is_slimpipe": forward_backward_func is handle.forward_backward_func,
            "slice_attention_layers": sum(isinstance(m, SliceCoreAttention) for m in model.modules()),
        }
    handle.remove()
    return [r["lm loss"] for r in reports], grads, ref_reports, ref_grads, facts

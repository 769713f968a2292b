"""Megatron-LM hooks for megatron-slim's CP engines: ``--cp-engine`` other than ``te`` with
``--context-parallel-size > 1`` (``hooks.py`` installs them; each is a no-op otherwise).

* **Layer spec**: the spec builders' core attention becomes ``CPCoreAttention`` and, with
  ``--cp-remap``, the layer becomes ``RemapTransformerLayer`` (``with_cp_attention``).
* **Batch split**: ``pretrain_gpt.py``'s ``get_batch`` calls ``get_batch_on_this_cp_rank(batch)``,
  bound by name from ``megatron.core.utils`` (megatron-core 0.16: defined there) or
  ``megatron.training.utils`` (Megatron-LM main). Its replacement derives the pack's sequence
  lengths (``cp.lengths.pack_lengths``: ``cu_seqlens`` / ``packed_seq_params``, else
  ``position_ids`` resets, else the whole row), plans the pack with the engine, sets the plan on
  the model's ``CPContext`` (collective over the CP group) and returns this rank's tokens with the
  batch's keys in their order: ``position_ids`` from the plan, ``attention_mask`` and the THD
  metadata (``cu_seqlens``, ``max_seqlen``, ``packed_seq_params``) set to ``None`` (the engine
  masks per sequence itself).
* **Forward-backward**: the function ``get_forward_backward_func`` returns is wrapped so that it
  attaches the ``CPContext`` to every model chunk and wraps the ``forward_step_func``'s loss
  function (``cp_wide_loss``).
* **Pipelines** (``PipelinePlans``): with pp > 1 the model config's ``variable_seq_lengths`` is
  set, so Megatron's 1F1B sends each stage-to-stage tensor's shape first (plans give CP ranks
  different token counts). Middle stages read no batch, nor (megatron-core 0.18 on) tokens the last,
  nor, under tensor parallelism, the last stage's TP ranks other than 0: then the first stage's TP
  rank 0 reads the call's microbatches up front and hands their sequence lengths to every stage and
  TP rank (``runtime/pipeline/stage_lengths.share_first_stage_lengths``, as the sliced path does); a
  middle stage plans each microbatch before its forward step, a last-stage rank without tokens plans
  them in ``split``, and the ranks that read tokens check their lengths against the handed ones.

**Loss normalisation.** megatron-core 0.16.1 ``schedules.forward_step_calc_loss`` takes the
3-tuple ``(loss, num_tokens, report)`` of ``pretrain_gpt.loss_func`` (``loss`` = sum of masked
token losses on this rank, ``num_tokens`` = this rank's masked-token count) and, unless
``--calculate-per-token-loss``, divides ``loss`` by ``num_tokens`` and by the microbatch count;
its DDP then scales gradients by ``1 / (dp * cp)`` and sums them over data x context parallel
ranks. With TE's zigzag split every CP rank holds ``L / cp`` tokens, so per-rank means average
to the pack's mean when masks are uniform; a CP engine gives ranks different token counts (and
masks are rarely uniform), so the average of per-rank means is not the pack's mean. The wrapper
returns ``(cp * loss, CP-wide num_tokens, report)`` instead (``cp.data.cp_normalised``): then
``(1 / cp) * sum over ranks of cp * loss_r / N = sum(loss_r) / N``, the reference. Under
``--calculate-per-token-loss`` megatron divides nothing per microbatch, sums ``num_tokens`` over
data x context parallel ranks in ``finalize_model_grads`` and scales the summed gradients by its
inverse -- already exact, so the tuple passes unchanged. The report stays ``[local_sum,
local_count]``: ``train_step`` sums it over data x context parallel ranks before dividing. The
legacy 2-tuple (a rank's mean loss, which megatron multiplies by ``cp``) cannot be made exact and
is refused.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_slim.megatron.cp.pipeline_plans import PipelinePlans
from megatron_slim.megatron.model.layer_specs import LayerSwap, with_core_attention

if TYPE_CHECKING:  # imported where first used: the hooks load before megatron is set up
    from megatron_slim.megatron.cp.attention import CPContext
    from megatron_slim.plan.cp.costs import CPCosts
    from megatron_slim.plan.cp.topology import CPTopology

THD_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "packed_seq_params")


def cp_engine_active(args: Any) -> bool:
    """True when the parsed Megatron args ask for a megatron-slim CP engine."""
    return (
        args is not None
        and getattr(args, "cp_engine", "te") not in (None, "te")
        and (getattr(args, "context_parallel_size", 1) or 1) > 1
        and not getattr(args, "use_slimpipe", False)
    )


def with_cp_attention(spec: Any, *, remap: bool) -> Any:
    """A copy of a layer spec / submodules / block spec with ``CPCoreAttention`` as core attention
    and, with ``remap``, ``RemapTransformerLayer`` as the layer module (where the spec names one)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_slim.megatron.cp.attention import CPCoreAttention
    from megatron_slim.megatron.cp.remap_layer import RemapTransformerLayer

    swap = LayerSwap(RemapTransformerLayer, (TransformerLayer,), "--cp-remap") if remap else None
    return with_core_attention(spec, CPCoreAttention, flag="--cp-engine", swap=swap)


def local_batch(batch: dict, plan, rank: int) -> dict:
    """``batch`` (keys in their order) cut to CP rank ``rank``'s tokens of ``plan``."""
    import torch

    from megatron_slim.megatron.cp.data import cp_batch

    drop = ("attention_mask", "position_ids") + THD_KEYS
    cut = cp_batch({k: v for k, v in batch.items() if k not in drop and torch.is_tensor(v)}, plan, rank)
    out = {}
    for key, value in batch.items():
        if key == "position_ids":
            out[key] = cut["position_ids"].to(value.device) if torch.is_tensor(value) else cut["position_ids"]
        elif key == "attention_mask" or key in THD_KEYS:
            out[key] = None
        else:
            out[key] = cut.get(key, value)
    return out


def cp_wide_loss(loss_func: Callable, cp_group, per_token_loss: bool, output_tensor, **kwargs):
    """``loss_func``'s local ``(loss_sum, num_tokens, report)`` normalised CP-wide (module docstring)."""
    from megatron_slim.megatron.cp.data import cp_normalised

    outputs = loss_func(output_tensor, **kwargs)
    if kwargs.get("non_loss_data"):
        return outputs
    if not isinstance(outputs, tuple) or len(outputs) != 3:
        raise ValueError(
            "--cp-engine: the loss function must return (loss_sum, num_tokens, report) as "
            "pretrain_gpt.loss_func does; a mean loss cannot be normalised over CP ranks holding "
            "different token counts"
        )
    loss, num_tokens, report = outputs
    return cp_normalised(loss, num_tokens, report, cp_group, per_token_loss=per_token_loss)


class CPHookState:
    """What the hooks share in one process: the model's ``CPContext`` (one CP group), the plan
    inputs (topology and costs from the args' hardware profile) and counters for tests."""

    def __init__(self, args_getter: Callable[[], Any]) -> None:
        self.args_getter = args_getter
        self.context: Optional[CPContext] = None
        self._setup: Optional[tuple[CPTopology, CPCosts]] = None
        self.plans_set = 0
        self.padded = 0  # packs that left a CP rank without tokens (it ran a padding row)
        self.length_sources: Counter = Counter()
        self.attached: list[int] = []
        self.expected: Optional[tuple[int, ...]] = None  # the first stage's lengths of this microbatch

    def active_args(self) -> Optional[Any]:
        args = self.args_getter()
        return args if cp_engine_active(args) else None

    def cp_context(self) -> CPContext:
        if self.context is None:
            from megatron.core import parallel_state

            from megatron_slim.megatron.cp.attention import CPContext

            self.context = CPContext(parallel_state.get_context_parallel_group())
        return self.context

    def plan_inputs(self, args: Any) -> tuple[CPTopology, CPCosts]:
        if self._setup is None:
            from megatron_slim.megatron.launch.args import recipe_from_megatron_args
            from megatron_slim.plan.cp.costs import CPCosts
            from megatron_slim.plan.cp.topology import CPTopology

            recipe = recipe_from_megatron_args(args)
            p = recipe.parallel
            self._setup = (CPTopology.from_hardware(recipe.hardware_profile, p.cp, p.tp), CPCosts.from_recipe(recipe))
        return self._setup

    # ---- batch split ----------------------------------------------------------------------------
    def split(self, args, batch: dict, cp_group=None) -> dict:
        from megatron_slim.megatron.cp.lengths import pack_lengths

        context = self.cp_context()
        if cp_group is not None and cp_group.size() != context.comm.size:
            raise ValueError(
                f"get_batch_on_this_cp_rank(cp_group of {cp_group.size()} ranks): the model's CP "
                f"group has {context.comm.size}"
            )
        if batch.get("tokens") is None and self.expected is not None:  # a last stage without tokens
            return local_batch(batch, self.plan_lengths(args, self.expected, "first stage"), context.rank)
        lengths, source = pack_lengths(batch)
        if self.expected is not None and self.expected != lengths:
            raise ValueError(
                f"--cp-engine: this stage read sequence lengths {lengths}, the first pipeline stage sent "
                f"{self.expected} for the same microbatch; allowed: every stage reads the same batches"
            )
        plan = self.plan_lengths(args, lengths, source)
        return local_batch(batch, plan, context.rank)

    def plan_lengths(self, args, lengths: tuple[int, ...], source: str):
        """Plan one pack of ``lengths`` and make it current (collective over the CP group)."""
        from megatron_slim.megatron.cp.data import plan_microbatch

        topo, costs = self.plan_inputs(args)
        plan, routing, remap = plan_microbatch(lengths, topo, costs, engine=args.cp_engine, remap=bool(args.cp_remap))
        self.cp_context().set_plan(plan, routing=routing, remap=remap)
        self.plans_set += 1
        self.padded += int(min(plan.tokens_per_rank()) == 0)
        self.length_sources[source] += 1
        return plan

    def wrap_batch_split(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def get_batch_on_this_cp_rank(batch, *args, **kwargs):
            parsed = self.active_args()
            if parsed is None:
                return original(batch, *args, **kwargs)
            return self.split(parsed, batch, kwargs.get("cp_group", args[0] if args else None))

        wrapped: Any = get_batch_on_this_cp_rank  # carries the state it shares with the other hooks
        wrapped.cp_state = self
        return wrapped

    # ---- forward-backward -----------------------------------------------------------------------
    def attach(self, chunks: list) -> None:
        import torch

        from megatron_slim.megatron.cp.attention import attach_context_parallel

        context = self.cp_context()
        for chunk in chunks:
            if id(chunk) in self.attached:
                continue
            found = attach_context_parallel(chunk, context)
            if found == 0:
                raise ValueError(
                    "--cp-engine: the model has no CPCoreAttention; its layer spec did not come from "
                    "megatron-core's GPT layer-spec builders (with --spec, build it with "
                    "megatron_slim.megatron.cp.attention.cp_layer_spec)"
                )
            if not self.attached and torch.distributed.get_rank() == 0:
                args = self.args_getter()
                print(
                    f"megatron-slim: --cp-engine {args.cp_engine}{' --cp-remap' if args.cp_remap else ''}: CP "
                    f"attention in {found} layers of the first chunk; every microbatch is planned from its sequence "
                    "lengths (cu_seqlens, else position-id resets, else the whole row), attention stays inside "
                    "each sequence",
                    flush=True,
                )
            self.attached.append(id(chunk))

    def wrap_forward_backward(self, forward_backward: Callable) -> Callable:
        @functools.wraps(forward_backward)
        def forward_backward_with_cp_engine(*args, **kwargs):
            from megatron.core.utils import get_model_config

            model = kwargs.get("model")
            chunks = list(model) if isinstance(model, (list, tuple)) else [model]
            self.attach(chunks)
            config = get_model_config(chunks[0])
            per_token = bool(getattr(config, "calculate_per_token_loss", False))
            group = self.cp_context().comm.group
            plans = self.pipeline_plans(kwargs, config)
            step = kwargs["forward_step_func"]

            @functools.wraps(step)
            def forward_step(*step_args, **step_kwargs):
                plans.before_forward()
                output, loss_func = step(*step_args, **step_kwargs)
                if loss_func is None:
                    return output, loss_func
                return output, functools.partial(cp_wide_loss, loss_func, group, per_token)

            kwargs["forward_step_func"] = forward_step
            return forward_backward(*args, **kwargs)

        return forward_backward_with_cp_engine

    def pipeline_plans(self, kwargs: dict, config: Any) -> PipelinePlans:
        """Under pipeline parallelism: stage-to-stage shapes that follow each plan and, unless every
        rank reads its tokens, the first stage's TP rank 0 sequence lengths on every stage and TP rank
        (``kwargs['data_iterator']`` is replaced there by the replay of what it read)."""
        from megatron.core import parallel_state

        from megatron_slim.megatron.compat import mcore_version
        from megatron_slim.megatron.cp.lengths import pack_lengths
        from megatron_slim.plan.startup.settings import last_stage_reads_tokens
        from megatron_slim.runtime.pipeline.stage_lengths import share_first_stage_lengths

        group = parallel_state.get_pipeline_model_parallel_group()
        if group is None or group.size() == 1:
            return PipelinePlans(self, None, reads_batches=True)
        config.variable_seq_lengths = True  # each microbatch's plan sets this rank's rows between stages
        tp_group = parallel_state.get_tensor_model_parallel_group()
        # the last stage's TP ranks other than 0 get no tokens from Megatron's TP batch broadcast
        if group.size() == 2 and tp_group.size() == 1 and last_stage_reads_tokens(mcore_version()[:2]):
            return PipelinePlans(self, None, reads_batches=True)
        iterator, lengths = share_first_stage_lengths(
            kwargs.get("data_iterator"),
            int(kwargs["num_microbatches"]),
            lambda batch: pack_lengths(batch)[0],
            group,
            tp_group,
            self.cp_context().device,
        )
        kwargs["data_iterator"] = iterator
        first_or_last = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
        return PipelinePlans(self, lengths, reads_batches=first_or_last)

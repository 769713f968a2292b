"""SlimPipe slices that follow a CP engine's plan under Megatron-LM's launcher (``--use-slimpipe``
with ``--cp-engine zeppelin | ring | ulysses`` and ``--context-parallel-size > 1``).

The same pieces as ``megatron-slim train``'s ``train/cp_slices.py`` (``megatron/cp/window_slices.py``):
at the start of every schedule call each rank with a data iterator reads the call's microbatches up
front, every rank plans every window once from its sequence lengths (``cp.lengths.pack_lengths``: the
position-id resets of ``--reset-position-ids``; whose lengths, below), and the pipeline stages and the
CP ranks compare one digest of the plans.
The windows then go to SlimPipe's slicing data iterator carrying their ``document_lengths``, the
plans' slice shares go on ``SliceContext.cp_shares`` (SlimPipe's ``SliceCoreAttention`` and
``SliceRotary`` read them) and set the rows between stages (``stage_rows``), and
``get_batch_on_this_cp_rank`` -- the name ``pretrain_gpt.get_batch`` calls on each slice -- returns
this CP rank's rows of the slice's share. The loss function is normalised CP-wide per slice
(``cp.hooks.cp_wide_loss``); SlimPipe's loss sums slices before dividing, giving the microbatch's
CP-wide mean.

Under Megatron-LM's ``pretrain_gpt.py`` only TP rank 0 of the first and last stages reads batches
(from megatron-core 0.18 the last stage's ``get_batch`` keeps no tokens, but its data iterator still
yields them). With pp > 1 or tp > 1 the sequence lengths therefore come from the first stage's TP
rank 0 (``runtime/pipeline/stage_lengths.first_rank_lengths``: two small broadcasts per call), every
rank plans the windows from them, and a rank that read the batches too checks its own lengths against
them. The plans' document lengths reach every stage and TP rank through the schedule's
``call_documents`` (the slice attention and RoPE read them from ``SliceContext.documents``). One model
chunk per rank, and no ``--sequence-parallel`` (a plan's row counts need not divide by tp): rule
``slimpipe-with-cp-engine`` refuses the rest.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

from megatron_slim.runtime.pipeline.documents import DOCUMENT_LENGTHS
from megatron_slim.runtime.pipeline.slice_context import SliceContext


def engine_slices_active(args: Any) -> bool:
    """True when the parsed Megatron args run SlimPipe slices on a CP engine's plans."""
    return (
        args is not None
        and bool(getattr(args, "use_slimpipe", False))
        and getattr(args, "cp_engine", "te") not in (None, "te")
        and (getattr(args, "context_parallel_size", 1) or 1) > 1
    )


class EngineSlices:
    """One process's plans of the current schedule call and what reads them (module docstring)."""

    def __init__(self, context: SliceContext, args_getter: Callable[[], Any], plan_inputs: Callable) -> None:
        self.context, self.args_getter, self.plan_inputs = context, args_getter, plan_inputs
        self.shares: list = []
        self.documents: list = []  # each microbatch's document lengths in the current call
        self.calls = 0  # schedule calls planned (tests read it)

    def active_args(self) -> Optional[Any]:
        args = self.args_getter()
        return args if engine_slices_active(args) else None

    @staticmethod
    def _groups():
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group(), parallel_state.get_pipeline_model_parallel_group()

    def stage_rows(self, microbatch: int, slice_: int) -> int:
        """This CP rank's rows of one slice between pipeline stages."""
        return self.shares[microbatch][slice_].rows(self._groups()[0].rank())

    def call_documents(self) -> list:
        """Each microbatch's document lengths in the current call, on every stage and TP rank."""
        return list(self.documents)

    def plan_call(
        self, args: Any, data_iterator: Any, num_microbatches: int, slice_lengths: Sequence[int], device: Any = "cpu"
    ) -> Any:
        """Plan the call's windows; returns the iterator that replays them with their document lengths
        (None where this rank reads no batches)."""
        from megatron_slim.megatron.cp.data import plan_microbatch
        from megatron_slim.megatron.cp.window_slices import plans_digest, window_shares
        from megatron_slim.megatron.slimpipe.stage import one_chunk_source
        from megatron_slim.runtime.agreement import check_agreement

        listed = isinstance(data_iterator, (list, tuple))
        source = one_chunk_source(data_iterator, f"--cp-engine {args.cp_engine} with --use-slimpipe")
        batches = [dict(next(source)) for _ in range(num_microbatches)] if source is not None else None
        topo, costs = self.plan_inputs(args)
        lengths = self._call_lengths(batches, num_microbatches, device)
        plans = [plan_microbatch(n, topo, costs, engine=args.cp_engine, remap=False) for n in lengths]
        cp_group, pp_group = self._groups()
        digest = plans_digest(plans)
        remedy = "every rank must read the same windows and plan them with the same flags"
        what = "call's CP plans of SlimPipe windows"
        check_agreement(digest, cp_group, device=device, ranks="CP ranks", what=what, remedy=remedy)
        if pp_group is not None:
            check_agreement(digest, pp_group, device=device, ranks="pipeline ranks", what=what, remedy=remedy)
        self.shares = window_shares(plans, slice_lengths)
        self.documents = [plan.lengths for plan, _, _ in plans]
        self.context.cp_shares = dict(enumerate(self.shares))
        self.context.documents_on_every_tp_rank = True  # call_documents feeds every TP rank
        self.calls += 1
        if batches is None:
            return [None] if listed else None
        replay = iter([{**b, DOCUMENT_LENGTHS: n} for b, n in zip(batches, self.documents)])
        return [replay] if listed else replay

    def _call_lengths(self, batches: Optional[list], num_microbatches: int, device: Any) -> list:
        """The call's sequence lengths (position-id resets) as the first stage's TP rank 0 read them, on
        every rank; a rank that read the batches too checks its own against them."""
        from megatron.core import parallel_state

        from megatron_slim.megatron.cp.lengths import pack_lengths
        from megatron_slim.runtime.pipeline.stage_lengths import first_rank_lengths

        own: Optional[list] = [pack_lengths(b)[0] for b in batches] if batches is not None else None
        pp_group = self._groups()[1]
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if (pp_group is None or pp_group.size() == 1) and tp_group.size() == 1 and own is not None:
            return own
        shared = first_rank_lengths(own, pp_group, tp_group, device)
        if len(shared) != num_microbatches or (own is not None and own != shared):
            raise ValueError(
                f"--cp-engine with --use-slimpipe: this rank read sequence lengths {own} of {num_microbatches} "
                f"microbatches, the first pipeline stage sent {shared}; allowed: every stage reads the same batches"
            )
        return shared

    def wrap_forward_backward(self, function: Callable, slice_lengths: Sequence[int]) -> Callable:
        """SlimPipe's forward-backward ``function`` (of ``slice_lengths``) that plans each call's windows
        first and normalises every slice's loss CP-wide."""
        from megatron_slim.megatron.cp.hooks import cp_wide_loss

        @functools.wraps(function)
        def forward_backward_with_engine_slices(**kwargs):
            from megatron.core.utils import get_model_config

            args = self.args_getter()
            model = kwargs["model"]
            chunk = model[0] if isinstance(model, (list, tuple)) else model
            config, device = get_model_config(chunk), next(chunk.parameters()).device
            per_token = bool(getattr(config, "calculate_per_token_loss", False))
            kwargs["data_iterator"] = self.plan_call(
                args, kwargs.get("data_iterator"), int(kwargs["num_microbatches"]), slice_lengths, device
            )
            step, cp_group = kwargs["forward_step_func"], self._groups()[0]

            @functools.wraps(step)
            def forward_step(*step_args, **step_kwargs):
                output, loss_func = step(*step_args, **step_kwargs)
                if loss_func is None:
                    return output, loss_func
                return output, functools.partial(cp_wide_loss, loss_func, cp_group, per_token)

            kwargs["forward_step_func"] = forward_step
            return function(**kwargs)

        return forward_backward_with_engine_slices

    def wrap_batch_split(self, split: Callable) -> Callable:
        """``get_batch_on_this_cp_rank`` that cuts a planned slice to this CP rank's rows of its share."""
        from megatron_slim.megatron.cp.window_slices import rows_of_share

        @functools.wraps(split)
        def get_batch_on_this_cp_rank(batch, *args, **kwargs):
            info = self.context.current if self.active_args() is not None else None
            shares = self.context.cp_shares.get(info.microbatch) if info is not None else None
            if info is None or shares is None:
                return split(without_document_lengths(batch), *args, **kwargs)
            return rows_of_share(batch, shares[info.slice], self._groups()[0].rank())

        wrapped: Any = get_batch_on_this_cp_rank
        wrapped.cp_state = getattr(split, "cp_state", None)
        wrapped.engine_slices = self
        return wrapped


def without_document_lengths(batch: Any) -> Any:
    """A SlimPipe slice's batch without its ``document_lengths`` (recorded on ``SliceContext.documents``
    when the slice was read): from megatron-core 0.19 ``pretrain_gpt.get_batch`` hands TP rank 0's
    whole batch dict to ``get_batch_on_this_cp_rank``, which cuts every value but its metadata keys
    along the sequence, and the lengths are a tuple (0.16's TP broadcast dropped unknown keys)."""
    if not isinstance(batch, dict) or DOCUMENT_LENGTHS not in batch:
        return batch
    return {k: v for k, v in batch.items() if k != DOCUMENT_LENGTHS}

"""The SlimPipe side of the launcher's hooks (``megatron/hooks.py`` installs them): the slice plan
from the parsed flags, the schedule function per parsed args with the ``SliceContext`` it runs
under, the TP batch broadcast sized for the current slice, and layer specs with
``SliceCoreAttention``. Megatron-Bridge's ``bridge.install`` reuses the plan and the spec rewrite.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_slim.megatron import compat
from megatron_slim.megatron.model.layer_specs import with_core_attention

if TYPE_CHECKING:
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings


def slimpipe_settings(args) -> "SlimPipeSettings":
    """The slice plan a Megatron run uses, from its flags (balanced slices need the cost model).
    ``--slimpipe-slice-policy exchange``: training calls run the context-exchange group plan made with
    the flags' recipe's costs, the one ``megatron-slim simulate`` and ``megatron-slim train`` use for it."""
    from megatron_slim.megatron.launch.args import recipe_from_megatron_args
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings
    from megatron_slim.plan.cost.calibration import load_calibration
    from megatron_slim.plan.cost.model import CostModel
    from megatron_slim.plan.sim.costs import slice_lengths

    recipe = recipe_from_megatron_args(args)
    calibration = (
        load_calibration(args.slimpipe_calibration, "--slimpipe-calibration") if args.slimpipe_calibration else None
    )
    lengths = slice_lengths(recipe, CostModel(recipe, calibration=calibration))
    backend = None if args.megatron_slim_attention_backend == "auto" else args.megatron_slim_attention_backend
    exchange = args.slimpipe_slice_policy == "exchange"
    return SlimPipeSettings(
        lengths,
        attention_backend=backend,
        offload_ratio=float(getattr(args, "slimpipe_offload_ratio", 0.0) or 0.0),
        share_documents=packed_windows(args),
        exchange=exchange,
        exchange_recipe=recipe if exchange else None,
    )


def packed_windows(args) -> bool:
    """Whether the run's windows are packs of documents: ``--slimpipe-packing``, or Megatron's THD
    batches (``cu_seqlens`` from ``--sft``, or 0.19's ``--dataloader-inter-document-masking``). The
    middle pipeline stages then get each window's documents from the first stage: they read no batch."""
    packing = (getattr(args, "slimpipe_packing", None) or "none") != "none"
    thd = getattr(args, "sft", False) or getattr(args, "dataloader_inter_document_masking", False)
    return packing or bool(thd)


class SlimPipeHookState:
    """What the SlimPipe hooks share in one process: the schedule function per parsed args, and the
    ``SliceContext`` it runs under (the TP batch hook reads the current slice from it)."""

    def __init__(self, args_getter: Callable[[], Any], plan_inputs: Optional[Callable] = None) -> None:
        from megatron_slim.megatron.slimpipe.engine_slices import EngineSlices
        from megatron_slim.runtime.pipeline.slice_context import SliceContext

        self.args_getter = args_getter
        self.context = SliceContext()
        self._functions: dict[int, Callable] = {}
        # slices that follow a CP engine's plans (--cp-engine); plan_inputs: (topology, costs) of the args
        self.engine_slices = EngineSlices(self.context, args_getter, plan_inputs) if plan_inputs else None

    def active_args(self) -> Optional[Any]:
        args = self.args_getter()
        return args if args is not None and getattr(args, "use_slimpipe", False) else None

    def forward_backward_func(self, args) -> Callable:
        if id(args) not in self._functions:
            from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func

            settings = slimpipe_settings(args)
            engine = self.engine_slices if self.engine_slices is not None and self.engine_slices.active_args() else None
            rows = engine.stage_rows if engine is not None else None
            documents = engine.call_documents if engine is not None else None
            vocab_parallel = bool(getattr(args, "slimpipe_vocab_parallel", False))
            vocab = None
            if vocab_parallel:
                from megatron_slim.megatron.slimpipe.vocab_launch import LauncherVocab

                vocab = LauncherVocab()
            function: Callable = make_forward_backward_func(
                settings, context=self.context, stage_rows=rows, call_documents=documents, vocab_head=vocab
            )
            if vocab is not None:
                from megatron_slim.megatron.slimpipe.vocab_launch import with_launcher_vocab

                function = with_launcher_vocab(function, vocab)
            if engine is not None:  # functools.wraps keeps the function's stats and settings
                function = engine.wrap_forward_backward(function, settings.slice_lengths)
            rank = int(getattr(args, "rank", 0) or 0)
            reports = settings.exchange or settings.offload_ratio > 0
            self._functions[id(args)] = reporting_first_call(function, rank) if reports else function
            if rank == 0:
                print(
                    f"megatron-slim: SlimPipe schedule, {settings.num_slices} {args.slimpipe_slice_policy} slice(s) "
                    f"per microbatch of {args.seq_length} tokens: {list(settings.slice_lengths)}"
                    + (f", following --cp-engine {args.cp_engine}'s plan of each window" if engine else "")
                    + (", vocabulary on every pipeline rank" if vocab_parallel else "")
                    + (
                        f", {settings.offload_ratio:g} of the layers' activations offloaded"
                        if settings.offload_ratio
                        else ""
                    ),
                    flush=True,
                )
        return self._functions[id(args)]


def reporting_first_call(function: Callable, rank: int) -> Callable:
    """``function`` that, after its first training call, prints what this rank's context exchange did
    in it (K/V tokens shipped as a sender, attention blocks served as a peer) and what its activation
    offload moved to host memory (``--slimpipe-offload-ratio``), whichever of the two the run does."""
    reported = False

    @functools.wraps(function)  # keeps the function's stats and settings
    def forward_backward(**kwargs):
        nonlocal reported
        result = function(**kwargs)
        if not reported and not kwargs.get("forward_only", False):
            reported = True
            stats, settings = function.stats, function.settings  # type: ignore[attr-defined]
            if settings.exchange:
                print(
                    f"megatron-slim: context exchange on rank {rank}: {stats.exchanged_tokens} K/V tokens shipped, "
                    f"{stats.served_blocks} attention blocks served in the first training call",
                    flush=True,
                )
            if settings.offload_ratio > 0:
                print(
                    f"megatron-slim: activation offload on rank {rank}: {stats.offloaded_bytes} bytes held in host "
                    "memory in the first training call",
                    flush=True,
                )
        return result

    return forward_backward


def with_slice_length(original: Callable, slim_state: SlimPipeHookState) -> Callable:
    """``get_batch_on_this_tp_rank`` that, while a SlimPipe slice is current, sizes the other TP
    ranks' receive buffers for the slice TP rank 0 read from the slicing data iterator.

    0.18+ take ``seq_length`` as an argument; 0.14-0.17 read ``get_args().seq_length``, which is
    set to the slice's length for the duration of the call.
    """
    takes_length = compat.has_parameter(original, "seq_length")
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args, **kwargs):
        info = slim_state.context.current if slim_state.active_args() is not None else None
        if info is None:
            return original(*args, **kwargs)
        if takes_length:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["seq_length"] = info.length
            return original(*bound.args, **bound.kwargs)
        megatron_args = slim_state.args_getter()
        full_length = megatron_args.seq_length
        megatron_args.seq_length = info.length
        try:
            return original(*args, **kwargs)
        finally:
            megatron_args.seq_length = full_length

    return get_batch_on_this_tp_rank


def with_slice_attention(spec: Any) -> Any:
    """A copy of a layer spec / submodules / block spec with SliceCoreAttention as core attention."""
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    return with_core_attention(spec, SliceCoreAttention, flag="--use-slimpipe")

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
    """The slice plan a Megatron run uses, from its flags (balanced slices need the cost model)."""
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
    packing = (getattr(args, "slimpipe_packing", None) or "none") != "none"
    return SlimPipeSettings(lengths, attention_backend=backend, share_documents=packing)


class SlimPipeHookState:
    """What the SlimPipe hooks share in one process: the schedule function per parsed args, and the
    ``SliceContext`` it runs under (the TP batch hook reads the current slice from it)."""

    def __init__(self, args_getter: Callable[[], Any]) -> None:
        from megatron_slim.runtime.pipeline.slice_context import SliceContext

        self.args_getter = args_getter
        self.context = SliceContext()
        self._functions: dict[int, Callable] = {}

    def active_args(self) -> Optional[Any]:
        args = self.args_getter()
        return args if args is not None and getattr(args, "use_slimpipe", False) else None

    def forward_backward_func(self, args) -> Callable:
        if id(args) not in self._functions:
            from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func

            settings = slimpipe_settings(args)
            vocab_parallel = bool(getattr(args, "slimpipe_vocab_parallel", False))
            if vocab_parallel:
                from megatron_slim.megatron.slimpipe.vocab_launch import LauncherVocab, with_launcher_vocab

                vocab = LauncherVocab()
                function = make_forward_backward_func(settings, context=self.context, vocab_head=vocab)
                self._functions[id(args)] = with_launcher_vocab(function, vocab)
            else:
                self._functions[id(args)] = make_forward_backward_func(settings, context=self.context)
            if int(getattr(args, "rank", 0) or 0) == 0:
                print(
                    f"megatron-slim: SlimPipe schedule, {settings.num_slices} {args.slimpipe_slice_policy} slice(s) "
                    f"per microbatch of {args.seq_length} tokens: {list(settings.slice_lengths)}"
                    + (", vocabulary on every pipeline rank" if vocab_parallel else ""),
                    flush=True,
                )
        return self._functions[id(args)]


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

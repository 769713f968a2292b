"""``--slimpipe-vocab-parallel`` under Megatron-LM's own training loop (``python -m
megatron_slim.launch pretrain_gpt.py ...``): the word embedding, output layer and loss on every
pipeline rank, run by the same exchanges as ``megatron-slim train`` (``runtime/pipeline/vocab*.py``).

What the launcher adds around the SlimPipe schedule function, per call:

* the rank's ``VocabHead`` is built once, on the first call, from Megatron's (DDP-wrapped) model
  chunks with train's ``build_vocab_head``; replicas are outside the model, so the optimizer,
  checkpoints and the parameter count see Megatron's usual parameters;
* before the schedule runs, replicas take the owners' weights (``VocabHead.refresh``);
* the script's ``forward_step`` is run as it is, except that the last stage's model returns its
  final hidden states and the loss function hands on the labels and loss mask the script passed to
  the model (``labels=``, ``loss_mask=``), which the vocabulary exchange computes the loss from;
* before Megatron's ``finalize_model_grads`` (data-parallel all-reduce, then the tied embedding's
  all-reduce between the first and last stage over Megatron's embedding group), the owners get the
  replicas' gradients (``VocabHead.reduce_grads``): into ``main_grad``, where Megatron's DDP keeps
  them; tied, the first stage keeps its own gradient out, since the embedding group adds it after.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from megatron_slim.megatron.model.vocab_head import build_vocab_head, final_hidden_states, unwrapped
from megatron_slim.runtime.pipeline.vocab_weights import VocabHead


@dataclass(frozen=True)
class _PipelineGroups:
    """The part of megatron-slim's ``ModelGroups`` that ``build_vocab_head`` reads."""

    pp: Any
    pp_size: int
    pp_rank: int
    cp: Any = None
    cp_size: int = 1


class LauncherVocab:
    """This process's ``VocabHead`` over Megatron's model chunks, built on first use; passed to
    ``make_forward_backward_func`` as ``vocab_head`` (it is called with the call's chunks)."""

    def __init__(self) -> None:
        self.head: Optional[VocabHead] = None
        self._chunks: tuple[int, ...] = ()

    def __call__(self, models: list) -> VocabHead:
        chunks = [unwrapped(m) for m in models]
        if self.head is None:
            self.head, self._chunks = build_vocab_head(chunks, _megatron_groups()), tuple(map(id, chunks))
        elif tuple(map(id, chunks)) != self._chunks:
            raise RuntimeError("--slimpipe-vocab-parallel: the model chunks changed between calls")
        return self.head


def _megatron_groups() -> _PipelineGroups:
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_group()
    return _PipelineGroups(pp, dist.get_world_size(pp), dist.get_rank(pp))


def with_launcher_vocab(function: Callable, vocab: LauncherVocab) -> Callable:
    """``function`` (a SlimPipe forward-backward function made with ``vocab_head=vocab``) as
    Megatron's loop calls it under ``--slimpipe-vocab-parallel`` (see the module doc)."""

    @functools.wraps(function)
    def forward_backward(*, forward_step_func, model, forward_only: bool = False, **kwargs: Any):
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        head = vocab(models)
        head.refresh()
        step = hidden_states_step(forward_step_func)
        with _reduced_before_finalize(models, head, forward_only):
            result = function(forward_step_func=step, model=model, forward_only=forward_only, **kwargs)
        return result

    forward_backward.stats = function.stats  # type: ignore[attr-defined]
    forward_backward.settings = function.settings  # type: ignore[attr-defined]
    return forward_backward


@contextlib.contextmanager
def _reduced_before_finalize(models: list, head: VocabHead, forward_only: bool) -> Iterator[None]:
    """Within it, the models' ``finalize_model_grads_func`` first gives the owners the replicas'
    gradients (after the call if Megatron set none)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(models[0])
    finalize = getattr(config, "finalize_model_grads_func", None)
    if forward_only:
        yield
        return
    if finalize is None:
        yield
        head.reduce_grads(sum_owned_copies=False)
        return

    def finalize_model_grads(*args: Any, **kwargs: Any):
        head.reduce_grads(sum_owned_copies=False)
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = finalize_model_grads
    try:
        yield
    finally:
        config.finalize_model_grads_func = finalize


def hidden_states_step(forward_step_func: Callable) -> Callable:
    """The script's ``forward_step`` with the last stage's model returning its final hidden states
    and the loss function handing on ``(labels, loss_mask)`` (``train.microbatch.vocab_targets``)."""
    from megatron_slim.train.microbatch import vocab_targets

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator, model, *args: Any, **kwargs: Any):
        gpt = unwrapped(model)
        if not gpt.post_process:
            return forward_step_func(data_iterator, model, *args, **kwargs)
        seen: dict = {}
        model_forward = gpt.forward

        def forward(*inputs: Any, labels=None, loss_mask=None, **rest: Any):
            seen["labels"], seen["loss_mask"] = labels, loss_mask
            return model_forward(*inputs, **rest)

        gpt.forward = forward
        try:
            with final_hidden_states(gpt):
                output, _ = forward_step_func(data_iterator, model, *args, **kwargs)
        finally:
            del gpt.forward
        if seen.get("labels") is None or seen.get("loss_mask") is None:
            raise ValueError(
                "--slimpipe-vocab-parallel: the script's forward_step must pass labels= and loss_mask= to the "
                "model, as pretrain_gpt.py's does; got "
                f"labels={'set' if seen.get('labels') is not None else None}, "
                f"loss_mask={'set' if seen.get('loss_mask') is not None else None}"
            )
        return output, functools.partial(vocab_targets, seen["labels"], seen["loss_mask"])

    return forward_step

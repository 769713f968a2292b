"""One schedule call's CP plans on one pipeline stage, in forward order (``cp/hooks.py``'s
``CPHookState.pipeline_plans`` makes them; see its module docstring, **Pipelines**)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_slim.megatron.cp.hooks import CPHookState


class PipelinePlans:
    """One schedule call's microbatch plans on this pipeline stage: a stage that reads batches plans
    them in ``split`` (from the first stage's lengths when shared: checked against its own tokens, or
    taken as they are on a last stage that Megatron hands no tokens); a middle stage plans each
    microbatch from the shared lengths before its forward step (1F1B runs forwards in order)."""

    def __init__(self, state: CPHookState, lengths: Optional[list], *, reads_batches: bool) -> None:
        self.state, self.lengths, self.reads_batches, self.next = state, lengths, reads_batches, 0

    def before_forward(self) -> None:
        if self.lengths is None:
            return
        if self.next >= len(self.lengths):
            raise RuntimeError(
                f"--cp-engine: forward step {self.next + 1} of a call with {len(self.lengths)} microbatches"
            )
        lengths = self.lengths[self.next]
        self.next += 1
        if self.reads_batches:
            self.state.expected = lengths
        else:
            self.state.plan_lengths(self.state.args_getter(), lengths, "first stage")

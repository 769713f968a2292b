"""A CP rank that its plan leaves without tokens runs one padding row through the model.

Plans may leave a CP rank empty: ring, allgather and a2a+p2p cut every sequence into ``2g`` zigzag
chunks, so a pack of one-token documents lands on a single rank; a pack with fewer tokens than CP
ranks leaves some rank empty under every engine. The attention engine runs such a rank as it is (it
takes part in every ring step, all-gather and all-to-all with empty blocks), but megatron-core
cannot run a layer on zero tokens (its attention reshapes ``[0, b, -1, d]``). So the rank's model
input is one padding row, which changes no result:

* ``cp.data.cp_batch`` gives it the pack's first token at position 0 with ``loss_mask`` 0;
* ``CPCoreAttention`` gives it an attention output of zeros (it attends to nothing and no token of
  the pack attends to it); the engine runs on the rank's planned rows only;
* ``RemapTransformerLayer`` keeps it out of the move; its MLP contribution is zero too (the hidden
  state passes unchanged).

Its loss is masked and nothing reads its activations, so every gradient it adds is exactly zero.
"""

from __future__ import annotations

import torch

from megatron_slim.plan.cp.layout import CPPlan

PADDING_ROWS = 1


def padding_rows(plan: CPPlan, rank: int) -> int:
    """Rows ``rank`` runs beyond the plan's tokens: one when the plan gives it none, else zero."""
    return PADDING_ROWS if plan.ranks[rank].num_tokens == 0 else 0


def split_padding(x: torch.Tensor, planned: int, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cut along ``dim`` into the plan's ``planned`` rows and the padding rows after them."""
    return x.narrow(dim, 0, planned), x.narrow(dim, planned, x.shape[dim] - planned)

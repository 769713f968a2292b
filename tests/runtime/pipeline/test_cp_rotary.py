"""RoPE under SlimPipe x CP: a rank's tokens of slice j get slice start + their zigzag positions.

``GPTModel`` asks its rotary embedding for ``local * cp`` rows (``get_rotary_seq_len``);
``SliceRotary`` adds the slice's start as the offset and the CP-aware table cuts the slice's rows
zigzag-wise. Checked against rows picked from one whole-sequence table by position."""

import pytest
import torch

from megatron_slim.megatron.model.rotary import make_cpu_rotary_embedding
from megatron_slim.megatron.slimpipe.slicing import SliceRotary
from megatron_slim.runtime.pipeline.slice_context import SliceContext, SliceInfo
from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout


class _Group:
    """Stands in for a CP process group: the rotary only asks for rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _rotary(cp_group=None):
    return make_cpu_rotary_embedding(
        kv_channels=16, rotary_percent=1.0, rotary_base=10000.0, use_cpu_initialization=True, cp_group=cp_group
    )


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", [(16, 8, 24), (48,)])
def test_slice_rotary_gives_true_positions_under_cp(cp, lengths):
    whole = _rotary()(sum(lengths))  # [s, 1, 1, dim] for positions 0 .. s-1
    for rank in range(cp):
        context = SliceContext()
        rotary = SliceRotary(_rotary(_Group(rank, cp)), context)
        start = 0
        for j, n in enumerate(lengths):
            with context.enter(SliceInfo(0, j, len(lengths), start, n)):
                table = rotary(n, packed_seq=False, cp_group=None)  # what GPTModel._preprocess calls
            want = whole[start + ZigzagLayout(cp, n).positions(rank)]
            assert torch.equal(table, want), (rank, j)
            start += n

"""``VocabHead.reduce_grads`` over gloo (3 pipeline ranks) with Megatron-LM's DDP layout (owned
copies' gradients in ``main_grad``): by default every whole copy gets the sum of all copies;
``sum_owned_copies=False`` (the launcher, tied) leaves the first stage's own gradient on it and gives
the last stage everything else, so Megatron's embedding-group sum of the two is the whole gradient;
sharded, the owner gets each replica's rows added to its own."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.runtime.pipeline import _vocab_grad_workers as workers

PP = 3


def _own(rank: int, rows: int = workers.VOCAB) -> torch.Tensor:
    return workers.rank_grad(rank, rows)


@pytest.mark.parametrize("sum_owned_copies", [True, False])
def test_whole_copies(sum_owned_copies):
    got = run_ranks(workers.reduce_copies, PP, False, sum_owned_copies, timeout_s=300)
    total = _own(0) + _own(1) + _own(2)
    if sum_owned_copies:
        for grad in got:
            torch.testing.assert_close(grad, total)
        return
    torch.testing.assert_close(got[0], _own(0))
    torch.testing.assert_close(got[-1], _own(1) + _own(2))
    torch.testing.assert_close(got[0] + got[-1], total)  # what Megatron's embedding group sums to


def test_sharded_copies_add_their_rows_to_the_owner():
    got = run_ranks(workers.reduce_copies, PP, True, False, timeout_s=300)
    want = _own(2).clone()
    lo = 0
    for rank, rows in enumerate(torch.tensor_split(torch.arange(workers.VOCAB), PP)[:-1]):
        want[lo : lo + len(rows)] += _own(rank, len(rows))
        lo += len(rows)
    torch.testing.assert_close(got[-1], want)

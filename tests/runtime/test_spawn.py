import pytest

from megatron_slim.runtime.spawn import RankFailed, run_ranks
from tests.runtime import _spawn_fns


def test_run_ranks_returns_results_in_rank_order():
    assert run_ranks(_spawn_fns.allreduce_rank, 3) == [3.0, 3.0, 3.0]


def test_failure_on_one_rank_raises_with_its_traceback():
    with pytest.raises(RankFailed, match="boom on rank 1"):
        run_ranks(_spawn_fns.fail_on_one, 2, timeout_s=60)

"""The contract tier's launches fork from the harness's launch server (``forkrun.py``) instead of
starting under torchrun; both must run the same thing. The same launch through megatron-slim's
launcher, under torchrun and forked, records the same per-iteration lm loss and grad norm bit for
bit and says the same start-up line (plain Megatron-LM launches fork the same way: the slow tier
checks them too), and a rank's failure fails the launch with its message."""

import pytest

from tests.processes import running
from tests.real_megatron.harness import TINY, megatron_args, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
SLIMPIPE = ["parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=4"]
PLAIN = ["parallel.pp=2", "schedule.kind=1f1b", "schedule.num_slices=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.mark.parametrize(
    "launcher,sets",
    [(True, SLIMPIPE), pytest.param(False, PLAIN, marks=pytest.mark.slow)],
    ids=["megatron-slim", "megatron"],
)
def test_a_forked_launch_records_what_a_torchrun_launch_records(tmp_path, corpus, launcher, sets):
    flags = megatron_args(list(TINY) + sets)
    runs = {
        p: run_pretrain(2, flags, tmp_path / p, launcher=launcher, data_prefix=corpus, processes=p)
        for p in ("torchrun", "fork")
    }
    torchrun, fork = runs["torchrun"], runs["fork"]
    assert len(torchrun.losses) == 3 and torchrun.losses[-1] < torchrun.losses[0]
    assert (fork.losses, fork.grad_norms, fork.skipped) == (torchrun.losses, torchrun.grad_norms, torchrun.skipped)
    for run in (torchrun, fork):
        assert ("megatron-slim: SlimPipe schedule" in run.log) == launcher


def test_a_failing_rank_fails_a_forked_launch_with_its_message(tmp_path, corpus):
    flags = megatron_args(list(TINY) + SLIMPIPE) + ["--reset-attention-mask"]  # refused at start-up
    with pytest.raises(AssertionError, match="exited 2") as failed:
        run_pretrain(2, flags, tmp_path / "fork", launcher=True, data_prefix=corpus, processes="fork")
    assert "drop --reset-attention-mask" in str(failed.value)


SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
time.sleep(float(sys.argv[2]))
"""


def test_a_launch_past_its_timeout_is_stopped_and_the_server_serves_the_next(tmp_path):
    """The ranks of a launch that outlives its timeout are gone when the harness raises; the same
    server then runs the next launch (here a script that exits at once)."""
    import os
    import time

    from tests.real_megatron import launch_server
    from tests.real_megatron.harness import REPO, SHIM, installed_tag

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(MEGATRON_SLIM_TEST_CPU_SHIM="1", MEGATRON_SLIM_TEST_RECORD=str(tmp_path), OMP_NUM_THREADS="1")

    def request(seconds: float, name: str) -> dict:
        args = [str(tmp_path), str(seconds)]
        return dict(
            nproc=2, module=None, script=str(script), args=args, env=env, cwd=str(tmp_path), log=str(tmp_path / name)
        )

    with pytest.raises(launch_server.LaunchTimeout):
        launch_server.launch(installed_tag(), request(600, "slow.log"), env, timeout_s=5)
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(ranks) == 2
    deadline = time.monotonic() + 10
    while any(running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if running(p)]
    assert launch_server.launch(installed_tag(), request(0, "quick.log"), env, timeout_s=60) == 0

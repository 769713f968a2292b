"""Progress of long simulations: the planners report through a callback and stay pure; the
command layer shows a throttled line on stderr (in place on a terminal; in a log only after a
few seconds), never on stdout where ``--json -`` writes JSON."""

import io
import json

import pytest

from megatron_slim.cli import main
from megatron_slim.commands import progress as progress_module
from megatron_slim.commands.progress import ProgressLine
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.lengths import make_packs, parse_lengths
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule import walk
from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.cp.sim import simulate_cp
from megatron_slim.plan.sim.engine import simulate

SPEC = "lognormal:mean=4096,sigma=1.2,min=256,max=65536"
TWO_NODES = ["parallel.cp=16", "model.seq_length=65536"]  # of zeppelin-7b-h800's four: quicker, same paths


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_sees_nothing_of_a_short_run():
    stream, clock = io.StringIO(), Clock()
    with ProgressLine("megatron-slim simulate", stream, tty=False, clock=clock) as line:
        for done in range(10):
            clock.now += 0.4
            line.update(f"{done}/10 packs", done, 10)
    assert stream.getvalue() == ""


def test_a_log_gets_a_line_every_few_seconds_after_the_first_ones_with_eta_and_a_closing_line():
    stream, clock = io.StringIO(), Clock()
    first, every = progress_module.LOG_TIMING
    with ProgressLine("megatron-slim simulate", stream, tty=False, clock=clock) as line:
        line.update("0/100 packs", 0, 100)
        for done in range(1, 101):
            clock.now += 0.5  # 50 s in all: a steady 2 packs per second
            line.update(f"{done}/100 packs", done, 100)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and lines[-1] == "megatron-slim simulate: done in 50.0 s"
    shown = lines[:-1]
    assert len(shown) == int((50 - first) // every) + 1
    assert (
        shown[0] == f"megatron-slim simulate: {int(first * 2)}/100 packs | {first:.1f} s elapsed | "
        f"ETA {(100 - first * 2) / 2:.1f} s"
    )


def test_a_terminal_line_is_redrawn_in_place_and_erased_at_the_end():
    stream, clock = io.StringIO(), Clock()
    with ProgressLine("megatron-slim simulate", stream, tty=True, clock=clock) as line:
        for done in range(1, 21):
            clock.now += 0.1
            line.update(f"engine ring (1/1): {done}/20 packs", done, 20)
    text = stream.getvalue()
    assert "\n" not in text and text.endswith("\r\x1b[K")
    drawn = [part for part in text.split("\r") if part]
    assert 2 < len(drawn) - 1 < 20 and drawn[-1] == "\x1b[K"  # throttled; the last one erases the line
    assert all(part.startswith("megatron-slim simulate: engine ring (1/1): ") for part in drawn[:-1])


def test_the_eta_restarts_with_each_series_and_a_failure_is_said():
    stream, clock = io.StringIO(), Clock()
    with pytest.raises(KeyError), ProgressLine("x", stream, tty=False, clock=clock) as line:
        clock.now += 60
        line.update("checking 50/100", 50, 100, series="checking")
        line.update("simulating 0/100", 0, 100, series="simulating")
        clock.now += 20
        line.update("simulating 10/100", 10, 100, series="simulating")
        raise KeyError("boom")
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("ETA ?") and lines[1].endswith("ETA 3 min 00 s")
    assert lines[2] == "x: stopped after 1 min 20 s"


def test_the_pipeline_simulator_reports_each_phase_and_gives_the_same_result(monkeypatch):
    monkeypatch.setattr(walk, "EVERY", 32)  # several reports per walk of tiny-cpu's 256 actions
    recipe = load_recipe("tiny-cpu")
    p = recipe.parallel
    schedule = generate(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, recipe.schedule.num_slices)
    costs = RecipeCosts(recipe, CostModel(recipe))
    calls = []
    quiet, reported = simulate(schedule, costs), simulate(schedule, costs, lambda *c: calls.append(c))
    assert reported.iteration_time_s == quiet.iteration_time_s and reported.events == quiet.events
    phases = list(dict.fromkeys(phase for phase, _, _ in calls))
    assert phases == [
        "adding communication",
        "ordering receives",
        "checking completeness",
        "checking dependencies",
        "simulating",
    ]
    for phase in phases:
        done = [d for ph, d, total in calls if ph == phase]
        total = {t for ph, _, t in calls if ph == phase}
        assert len(done) > 2 and done == sorted(done) and max(done) <= total.pop()


def test_the_cp_simulator_reports_every_pack():
    recipe = load_recipe("zeppelin-7b-h800", ["train.global_batch_size=3", *TWO_NODES])
    packs = make_packs(parse_lengths(SPEC), recipe.model.seq_length, 3, seed=0)
    calls = []
    reported = simulate_cp(recipe, "ring", packs, progress=lambda *c: calls.append(c))
    assert calls == [("packs", 1, 3), ("packs", 2, 3), ("packs", 3, 3)]
    assert reported.iteration_time_s == simulate_cp(recipe, "ring", packs).iteration_time_s


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            [
                "--recipe",
                "zeppelin-7b-h800",
                "--cp-engine",
                "ring,zeppelin",
                "--lengths",
                SPEC,
                "--set",
                "train.global_batch_size=2",
                *(arg for setting in TWO_NODES for arg in ("--set", setting)),
            ],
            "engine zeppelin (2/2): 2/2 packs planned and simulated",
        ),
        (["--recipe", "tiny-cpu"], "slimpipe n4 uniform: simulating "),
    ],
)
def test_progress_goes_to_stderr_while_json_goes_to_stdout(argv, needle, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "LOG_TIMING", (0.0, 0.0))  # show every update
    assert main(["simulate", *argv, "--json", "-"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert needle in captured.err and "megatron-slim simulate: done in" in captured.err
    assert captured.err.index("done in") < captured.err.index("recipe ")  # closed before the results

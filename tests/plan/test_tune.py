"""The autotuner (``plan/tune``, ``megatron-slim plan``): its candidate space against the recipe's
own checks, its bounds and its choice against brute-force simulation of every candidate."""

import argparse
import json
from dataclasses import replace
from itertools import product

import pytest
import yaml

from megatron_slim.cli import main
from megatron_slim.commands.simulate import run_one
from megatron_slim.megatron.launch.flags import add_arguments, check_megatron_args, recipe_to_megatron_args
from megatron_slim.plan.cost.slicing import splits_uniformly
from megatron_slim.plan.paths import config_dir
from megatron_slim.plan.recipe import CPConfig, Recipe, load_recipe, recipe_from_dict
from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.schedule.lower import lower
from megatron_slim.plan.schema import ConfigError, apply_overrides
from megatron_slim.plan.sim.engine import simulate
from megatron_slim.plan.sim.exchange_timing import simulate_with_group_exchange
from megatron_slim.plan.startup import LAUNCHER, check
from megatron_slim.plan.tune import tune
from megatron_slim.plan.tune.bounds import first_backward_memory, memory_lower_bound, time_bounds
from megatron_slim.plan.tune.report import chosen, payload
from megatron_slim.plan.tune.runnable import Runnable, launch_settings
from megatron_slim.plan.tune.search import costs_of, search, simulations_of
from megatron_slim.plan.tune.space import (
    FAMILIES,
    Layout,
    candidate_recipe,
    candidates,
    layouts,
    recompute_options,
    usable_gpu_counts,
)

GIB = 2**30


def small_recipe(tmp_path, hbm_gib: float = 6.0, seq: int = 16384, layers: int = 4, gbs: int = 4):
    """A small Llama on an H800-like profile with ``hbm_gib`` of memory, so that some candidates do not fit."""
    hw = yaml.safe_load((config_dir() / "hardware" / "h800.yaml").read_text())
    hw.update(name="small-h800", hbm_bytes=int(hbm_gib * GIB))
    path = tmp_path / "small-h800.yaml"
    path.write_text(yaml.safe_dump(hw))
    model = dict(
        num_layers=layers,
        hidden_size=2048,
        ffn_hidden_size=5632,
        num_attention_heads=16,
        num_query_groups=4,
        vocab_size=32000,
        seq_length=seq,
    )
    return recipe_from_dict(
        {"model": model, "train": {"global_batch_size": gbs}, "hardware": str(path), "name": "small"}
    )


def test_layouts_are_exactly_the_valid_ones(tmp_path):
    recipe = small_recipe(tmp_path)
    gpus = 16
    valid = set()
    for tp, cp, pp in product(range(1, 17), repeat=3):
        if gpus % (tp * cp * pp) or tp > 8:
            continue
        dp = gpus // (tp * cp * pp)
        data = recipe.to_dict() | {"parallel": {"tp": tp, "cp": cp, "pp": pp, "dp": dp}}
        data["schedule"] = {"kind": "1f1b"}
        try:
            recipe_from_dict(data)
        except ConfigError:
            continue
        valid.add(Layout(tp, cp, pp, dp))
    assert set(layouts(recipe, gpus)) == valid and len(valid) > 10


def test_every_candidate_is_a_valid_recipe_on_the_gpus(tmp_path):
    recipe = small_recipe(tmp_path)
    cands = candidates(recipe, 8, ("1f1b", "interleaved", "slimpipe"))
    assert {c.kind for c in cands} == {"1f1b", "interleaved", "slimpipe"}
    granularities = {dict(c.recompute)["recompute"] for c in cands}
    assert granularities == {"none", "selective", "full"}
    assert {c.slice_policy for c in cands if c.kind == "slimpipe"} == {"uniform", "balanced", "exchange"}
    assert all(c.pp > 1 for c in cands if c.slice_policy == "exchange")  # on one rank it is uniform slices
    for c in cands:
        chunk = recipe.model.num_layers // (c.pp * c.vpp)
        assert c.recompute in recompute_options(chunk, offload=c.kind == "slimpipe")
        offload = dict(c.recompute)["offload_ratio"]
        assert offload == 0 or c.kind == "slimpipe"  # Megatron-LM's own schedules have no per-slice offload
        r = candidate_recipe(recipe, c)
        assert r.train.recompute_plan.offload_ratio == offload
        assert r.parallel.world_size == 8 and r.model.num_layers % (c.pp * c.vpp) == 0
        if c.kind == "slimpipe":
            assert c.num_slices >= 2 and splits_uniformly(r.model.seq_length, c.num_slices, r.slice_alignment)
        else:
            assert c.num_slices == 1 and (c.vpp == 1) == (c.kind == "1f1b")
    assert len(set(cands)) == len(cands)


def simulate_candidate(costs):
    """A candidate's simulation as ``megatron-slim simulate`` runs it: context exchange with its group plan."""
    p, s = costs.recipe.parallel, costs.recipe.schedule
    schedule = generate(s.kind, p.pp, p.vpp, costs.recipe.num_microbatches, s.num_slices)
    if s.slice_policy == "exchange":
        return simulate_with_group_exchange(lower(schedule), costs, costs.lengths)
    return simulate(schedule, costs)


def brute_force(recipe, cands):
    """Simulate every candidate; (fastest fit's time, every (candidate, time, peak))."""
    cap = recipe.hardware_profile.usable_hbm_bytes
    runs = []
    for c in cands:
        costs = costs_of(candidate_recipe(recipe, c), recipe.hardware_profile)
        res = simulate_candidate(costs)
        runs.append((c, costs, res.iteration_time_s, max(r.peak_memory_bytes for r in res.ranks)))
    fits = [t for _, _, t, peak in runs if peak <= cap]
    return (min(fits) if fits else None), runs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_choice_is_no_worse_than_any_candidate(tmp_path, family):
    recipe = small_recipe(tmp_path)
    # every fourth candidate (a fixed sample across layouts, recompute and offload) keeps brute force short
    cands = candidates(recipe, 4, FAMILIES[family], max_slices=8)[::4]
    fastest, runs = brute_force(recipe, cands)
    cap = recipe.hardware_profile.usable_hbm_bytes
    assert fastest is not None and any(peak > cap for *_, peak in runs)  # memory matters in this space
    assert family == "megatron" or any(c.slice_policy == "exchange" for c, *_ in runs)
    for c, costs, seconds, peak in runs:  # the bounds hold for every candidate
        cheap, full = time_bounds(costs), time_bounds(costs, every_stage=True)
        assert cheap.lower <= full.lower <= seconds * (1 + 1e-9) and cheap.estimate <= full.estimate, c.label
        p, s = costs.recipe.parallel, costs.recipe.schedule
        schedule = generate(s.kind, p.pp, p.vpp, costs.recipe.num_microbatches, s.num_slices)
        assert first_backward_memory(costs) <= memory_lower_bound(costs, schedule) <= peak * (1 + 1e-9), c.label
    exact = search(recipe, cands, max_simulations=None, callers=())  # the bound, on every candidate
    assert exact.best is not None and exact.best.iteration_time_s == pytest.approx(fastest, rel=1e-12)
    brute = sum(simulations_of(costs.recipe) for _, costs, *_ in runs)  # an exchange plan runs 3
    assert exact.best.peak_memory_bytes <= cap and exact.simulated < brute
    budgeted = search(recipe, cands, max_simulations=2, callers=())
    assert budgeted.simulated <= 2 and budgeted.best.peak_memory_bytes <= cap


def test_plan_json_holds_both_choices_and_the_speedup(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--recipe", "tiny-cpu", "--gpus", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for family in ("slimpipe", "megatron"):
        chosen = data[family]
        assert {"mfu", "iteration_time_s", "peak_memory_bytes", "parallel", "schedule", "train", "set"} <= set(chosen)
        p = chosen["parallel"]
        assert p["tp"] * p["cp"] * p["pp"] * p["dp"] == 8
        assert 0 < chosen["mfu"] < 1 and chosen["peak_memory_bytes"] <= data["hbm_cap_bytes"]
    assert data["slimpipe"]["schedule"]["kind"] == "slimpipe"
    assert data["megatron"]["schedule"]["kind"] in ("1f1b", "interleaved")
    assert data["speedup"] == pytest.approx(data["slimpipe"]["mfu"] / data["megatron"]["mfu"])
    text = capsys.readouterr().out
    assert "SlimPipe" in text and "Megatron baseline" in text and "speedup" in text


def test_the_search_reports_its_progress_per_family_and_phase(tmp_path):
    """``megatron-slim plan`` shows this as its progress line (it was silent for minutes)."""
    heard = []
    tune(small_recipe(tmp_path), 4, progress=lambda phase, done, total: heard.append((phase, done, total)))
    phases = [p for p, _, _ in heard]
    for family in FAMILIES:
        mine = [h for h in heard if h[0].startswith(f"{family}: ")]
        assert mine and {f"{family}: bounding candidates", f"{family}: simulating"} <= {p for p, _, _ in mine}
        assert all(0 <= done <= total for _, done, total in mine)
    assert phases.index("megatron: bounding candidates") > phases.index("slimpipe: simulating") or phases.index(
        "slimpipe: bounding candidates"
    ) > phases.index("megatron: simulating")  # one family after the other


def test_the_reported_set_keys_rebuild_the_choice_and_its_figures(tmp_path):
    """The reported ``--set`` keys rebuild a recipe whose ``megatron-slim simulate`` figures are the chosen ones."""
    recipe = small_recipe(tmp_path)
    result = tune(recipe, 4)
    for name, family in result.families.items():
        picked = payload(result)[name]
        rebuilt = recipe_from_dict(apply_overrides(recipe.to_dict(), picked["set"], Recipe))
        res = run_one(rebuilt).result
        assert res.mfu == pytest.approx(picked["mfu"]) and res.iteration_time_s == pytest.approx(
            family.best.iteration_time_s
        )
        assert max(r.peak_memory_bytes for r in res.ranks) == pytest.approx(picked["peak_memory_bytes"], abs=1)


def test_exchange_is_searched_with_its_group_plan_and_beats_the_other_policies(tmp_path):
    """On the small recipe's 4 GPUs, exchange is the exact optimum of SlimPipe's space (no recompute),
    the search reports its group plan's figures (not those of the uniform slices it starts from),
    and the reported ``--set`` keys rebuild a recipe ``megatron-slim simulate`` prints them for."""
    recipe = small_recipe(tmp_path)
    space = candidates(recipe, 4, FAMILIES["slimpipe"], max_slices=8)
    cands = [c for c in space if dict(c.recompute)["recompute"] == "none"]
    exact = search(recipe, cands, max_simulations=None, callers=())  # the bound, on every candidate
    best = exact.best.candidate
    assert best.slice_policy == "exchange" and best.pp > 1
    costs = costs_of(candidate_recipe(recipe, best), recipe.hardware_profile)
    grouped = simulate_candidate(costs)
    p, s = costs.recipe.parallel, costs.recipe.schedule
    plain = simulate(generate(s.kind, p.pp, p.vpp, costs.recipe.num_microbatches, s.num_slices), costs)
    assert exact.best.iteration_time_s == pytest.approx(grouped.iteration_time_s, rel=1e-12)
    assert grouped.iteration_time_s < plain.iteration_time_s  # the plan moved work
    rebuilt = recipe_from_dict(apply_overrides(recipe.to_dict(), chosen(exact.best, exact)["set"], Recipe))
    printed = run_one(rebuilt).result
    assert printed.iteration_time_s == pytest.approx(exact.best.iteration_time_s, rel=1e-12)
    assert max(r.peak_memory_bytes for r in printed.ranks) == pytest.approx(exact.best.peak_memory_bytes, abs=1)
    for policy in ("uniform", "balanced"):
        rival = search(recipe, [c for c in cands if c.slice_policy == policy], max_simulations=None).best
        assert rival is None or rival.iteration_time_s > exact.best.iteration_time_s


@pytest.mark.parametrize("setting", ["schedule.vocab_parallel=true", "data.packing=slimpack"])
def test_exchange_is_not_searched_where_train_and_the_launcher_refuse_it(tmp_path, setting):
    base = small_recipe(tmp_path)
    data = apply_overrides(base.to_dict(), [setting], Recipe)
    if setting.startswith("data."):
        data["data"]["path"] = ["/unused/prefix"]
    recipe = recipe_from_dict(data)
    cands = candidates(recipe, 4, FAMILIES["slimpipe"], max_slices=8)
    assert cands and {c.slice_policy for c in cands} == {"uniform", "balanced"}


@pytest.mark.parametrize("name", ["tiny-cpu", "llama2-7b-64k", "llama2-70b-512k"])
def test_the_usable_gpu_counts_are_exactly_the_counts_a_layout_uses(name):
    recipe = load_recipe(name)
    usable = usable_gpu_counts(recipe)
    assert usable == sorted(set(usable)) and all(layouts(recipe, g) for g in usable)
    assert [g for g in range(1, 600) if layouts(recipe, g)] == [g for g in usable if g < 600]


def test_a_huge_gpu_count_is_answered_at_once_with_the_nearest_usable_ones(capsys):
    """Finding the nearest usable counts was a scan of every count up to twice the request
    (minutes at --gpus 40000); they are now the neighbours in the list of usable counts."""
    assert main(["plan", "--recipe", "llama2-7b-64k", "--gpus", "1000000"]) == 2
    assert "--gpus 1000000: no layout" in (err := capsys.readouterr().err) and "nearest: 524288, 1048576" in err


def test_gpu_count_no_layout_uses_names_it_and_the_nearest(capsys):
    assert main(["plan", "--recipe", "tiny-cpu", "--gpus", "7"]) == 2
    err = capsys.readouterr().err
    assert "--gpus 7" in err and "nearest: 4, 8" in err and "model.num_layers=8" in err


def test_nothing_fits_says_the_smallest_peak_and_the_cap(tmp_path):
    recipe = small_recipe(tmp_path, hbm_gib=0.5, seq=65536)
    with pytest.raises(ConfigError) as info:
        tune(recipe, 4)
    text = str(info.value)
    cap = f"{recipe.hardware_profile.usable_hbm_bytes / GIB:.1f} GiB"
    assert f"slimpipe: nothing fits in {cap}" in text and f"megatron: nothing fits in {cap}" in text
    assert text.count("smallest peak found") == 2


def test_plan_prices_both_families_with_a_calibration(tmp_path):
    """A calibration ten times slower than the profile's efficiencies slows both choices down, and
    the JSON says which rates priced them."""
    recipe = small_recipe(tmp_path)
    slow = tmp_path / "slow.yaml"
    peak = recipe.hardware_profile.peak_bf16_flops
    points = [{"op": op, "work": 1e12, "seconds": 1e12 / (0.05 * peak)} for op in ("gemm", "attention_forward")]
    points.append({"op": "attention_backward", "work": 1e12, "seconds": 1e12 / (0.05 * peak)})
    slow.write_text(yaml.safe_dump({"hardware": "small-h800", "source": "test: 5% of peak", "measurements": points}))
    from megatron_slim.plan.cost.calibration import load_calibration

    calibrated = tune(recipe, 4, calibration=load_calibration(slow))
    plain = tune(recipe, 4)
    for name in plain.families:
        assert calibrated.families[name].best.iteration_time_s > 5 * plain.families[name].best.iteration_time_s
    assert payload(calibrated, calibration_source="test: 5% of peak")["kernel_rates"] == "test: 5% of peak"
    assert payload(plain)["kernel_rates"].startswith("hardware profile efficiencies")


def test_the_choice_is_what_megatron_args_and_the_launcher_accept(tmp_path):
    # 4 GiB: the fastest fits are SlimPipe at cp=2 with recomputation on its own query-out CP, or with
    # per-slice offload; megatron-args emits both and the launcher accepts them as emitted
    recipe = small_recipe(tmp_path, hbm_gib=4.0, seq=32768)
    cands = [c for c in candidates(recipe, 8, ("slimpipe",)) if c.pp == 1]
    kept = [c for c in cands if not dict(c.recompute)["offload_ratio"]]
    runs = search(recipe, kept, None)
    assert runs.best is not None and runs.best.candidate.cp > 1 and runs.refused == {}
    assert dict(runs.best.candidate.recompute)["recompute"] == "full"
    flags = recipe_to_megatron_args(runs.best.recipe)
    assert flags[flags.index("--recompute-granularity") + 1] == "full" and "--cp-engine" not in flags
    check(launch_settings(runs.best.recipe), LAUNCHER)
    # recomputation on a CP engine's planned windows stays refused, and the search drops it
    on_engine = replace(runs.best.recipe, cp=CPConfig(engine="zeppelin"))
    assert Runnable().refusal(on_engine) == "slimpipe-recompute"
    with pytest.raises(ConfigError, match="train.recompute"):
        recipe_to_megatron_args(on_engine)
    # with offload (--slimpipe-offload-ratio, any cp) the fastest fit offloads at cp=2, and it runs
    offloading = search(recipe, cands, None)
    best = offloading.best
    assert best is not None and best.candidate.cp > 1 and dict(best.candidate.recompute)["offload_ratio"]
    assert best.iteration_time_s < runs.best.iteration_time_s and offloading.refused == {}
    flags = recipe_to_megatron_args(best.recipe)
    assert flags[flags.index("--slimpipe-offload-ratio") + 1] == f"{dict(best.candidate.recompute)['offload_ratio']:g}"
    check(launch_settings(best.recipe), LAUNCHER)


def _launcher_namespace(flags: list[str]) -> argparse.Namespace:
    """``flags`` as the launcher parses them, enough for its start-up checks: megatron-slim's own flags
    through its parser (defaults included), Megatron-LM's as ``--name value`` or a bare ``--switch``."""
    args, rest = add_arguments(argparse.ArgumentParser()).parse_known_args(flags)
    for i, word in enumerate(rest):
        if word.startswith("--"):
            value = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else True
            setattr(args, word[2:].replace("-", "_"), int(value) if str(value).isdigit() else value)
    return args


def test_the_baseline_with_cp_is_launched_as_megatrons_own_cp(tmp_path):
    """The Megatron baseline's recipe names Megatron-LM's own CP, and its megatron-args flags pass the
    launcher's start-up checks as emitted: no megatron-slim engine beside sequence parallelism."""
    recipe = small_recipe(tmp_path, seq=32768)
    cands = [c for c in candidates(recipe, 8, FAMILIES["megatron"]) if c.cp > 1 and c.tp > 1]
    runs = search(recipe, cands, None)
    best = runs.best
    assert best is not None and best.recipe.parallel.sequence_parallel and runs.refused == {}
    assert best.recipe.cp.engine == "megatron" and "cp.engine=megatron" in chosen(best, runs)["set"]
    flags = recipe_to_megatron_args(best.recipe)
    assert not {"--cp-engine", "--reset-position-ids", "--reset-attention-mask", "--slimpipe-hardware"} & set(flags)
    args = _launcher_namespace(flags)
    assert args.context_parallel_size == best.candidate.cp and args.cp_engine == "te"
    check_megatron_args(args)
    # the same layout with a megatron-slim engine is what the launcher refuses
    ring = _launcher_namespace(recipe_to_megatron_args(replace(best.recipe, cp=CPConfig(engine="ring"))))
    with pytest.raises(ConfigError, match="--cp-engine ring with --sequence-parallel and TP > 1"):
        check_megatron_args(ring)

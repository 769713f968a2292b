"""What users pass to Megatron-LM, checked by each tag's real argument parser and validation.

* every shipped recipe's command line, exactly as ``scripts/slurm/pretrain_gpt.sbatch`` builds it
  (``megatron-slim megatron-args`` plus data, tokenizer and checkpoint flags), passes ``parse_args``
  + ``validate_args`` + megatron-slim's start-up checks, with a fake world size of the recipe's GPUs;
* unsupported combinations are rejected at start-up with megatron-slim's message;
* ``patches/pretrain_gpt.patch`` applies to each tag without fuzz.

Tags: the one paired with the installed megatron-core, plus any given in
``MEGATRON_SLIM_EXTRA_MCORE`` (``core_v0.17.1=DIR,core_v0.18.2=DIR``: a ``pip install --target DIR``
of the matching megatron-core, put first on ``PYTHONPATH``; ``make test-megatron-py312`` sets it).
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.real_megatron.harness import REPO, SHIM, installed_tag, tags_dir

pytestmark = pytest.mark.real_megatron
ALL_TAGS = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0")


def _tags() -> dict[str, str]:
    """tag -> extra PYTHONPATH entry holding its megatron-core ("" = the installed one)."""
    tags = {installed_tag().name: ""}
    for item in filter(None, os.environ.get("MEGATRON_SLIM_EXTRA_MCORE", "").split(",")):
        tag, _, site = item.partition("=")
        tags[tag] = site
    return tags


def _tag_param(tag: str):
    reason = (
        "megatron-core for this tag is not installed here (make test runs core_v0.16.1, "
        "make test-megatron-py312 the others)"
    )
    return pytest.param(tag, id=tag, marks=() if tag in _tags() else pytest.mark.skip(reason=reason))


def _parse(tag: str, flag_sets: list[dict], tmp_path: Path) -> dict[str, dict]:
    path = tmp_path / "flag_sets.json"
    path.write_text(json.dumps(flag_sets))
    site = _tags()[tag]
    env = dict(
        os.environ,
        MEGATRON_SLIM_TEST_CPU_SHIM="1",
        PYTHONPATH=os.pathsep.join(
            filter(None, [site, str(tags_dir() / tag), str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")])
        ),
    )
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("parse_flags.py")), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["name"]] = result
    assert len(results) == len(flag_sets), f"exit {done.returncode}:\n{(done.stdout + done.stderr)[-5000:]}"
    return results


def _sbatch_flags(recipe: str, recipe_set: str = "") -> list[str]:
    """The pretrain_gpt.py flags the SLURM script would run for ``recipe`` (its DRY_RUN output)."""
    env = dict(
        os.environ,
        RECIPE=recipe,
        RECIPE_SET=recipe_set,
        DRY_RUN="1",
        MEGATRON_SLIM=f"{sys.executable} -m megatron_slim.cli",
        MEGATRON_LM="/opt/Megatron-LM",
        PYTHONPATH=str(REPO),
    )
    env.pop("SLURM_NNODES", None)
    env.pop("SLURM_JOB_NODELIST", None)
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    launch = done.stdout.splitlines()[0]  # the command every node runs
    words = shlex.split(launch.split(": ", 1)[1])
    return words[words.index("/opt/Megatron-LM/pretrain_gpt.py") + 1 :]


@functools.cache
def _sbatch_tail(recipe: str) -> tuple[str, ...]:
    """What the SLURM script adds after ``megatron-args``'s flags for ``recipe`` (data, tokenizer,
    checkpoints); the script is checked to build exactly that prefix once per recipe."""
    from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
    from megatron_slim.plan.recipe import load_recipe

    flags, model = _sbatch_flags(recipe), recipe_to_megatron_args(load_recipe(recipe))
    assert flags[: len(model)] == model, "the SLURM script's flags start with megatron-args'"
    return tuple(flags[len(model) :])


def _variant_flags(recipe: str, sets: list[str]) -> list[str]:
    """The SLURM script's flags for ``RECIPE=recipe RECIPE_SET="sets"``, without running it again per
    variant (it runs ``megatron-args --recipe recipe --set sets`` and appends ``_sbatch_tail``)."""
    from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
    from megatron_slim.plan.recipe import load_recipe

    return recipe_to_megatron_args(load_recipe(recipe, sets)) + list(_sbatch_tail(recipe))


# Flag sets by group: each test checks one group. A tag's groups are parsed together, in one run of
# parse_flags.py (importing Megatron-LM is most of its time), by the first test that asks for that tag.
# TEST_GROUPS (below) names each test's group; a test of this module that parses flags must be in it.
FLAG_GROUPS: dict[str, Callable[[Path], list[dict]]] = {}


def flag_group(build: Callable[[Path], list[dict]]) -> Callable[[Path], list[dict]]:
    cached = functools.cache(build)
    FLAG_GROUPS[build.__name__] = cached
    return cached


@flag_group
def shipped_recipe_flags(folder: Path) -> list[dict]:
    from megatron_slim.plan.recipe import available_recipes, load_recipe

    names = available_recipes()
    return [{"name": n, "world_size": load_recipe(n).parallel.world_size, "argv": _sbatch_flags(n)} for n in names]


@flag_group
def recompute_flags(folder: Path) -> list[dict]:
    """``train.recompute*`` as ``megatron-args`` spells them (8 layers per stage: every block depth)."""
    from megatron_slim.plan.recompute import Recompute, recompute_choices

    choices = recompute_choices(8) + (Recompute("full", "uniform", 4), Recompute("selective", modules=("layernorm",)))
    base = ["schedule.kind=1f1b", "schedule.num_slices=1"]
    return [
        {"name": str(c), "world_size": 64, "argv": _variant_flags("llama2-7b-64k", base + list(c.overrides()))}
        for c in choices
    ]


@functools.cache
def _megatron_baseline(folder: Path):
    from megatron_slim.plan.tune.search import search
    from megatron_slim.plan.tune.space import FAMILIES, candidates
    from tests.plan.test_tune import small_recipe

    recipe = small_recipe(folder, seq=32768)
    return search(recipe, [c for c in candidates(recipe, 8, FAMILIES["megatron"]) if c.cp > 1 and c.tp > 1], None).best


@flag_group
def baseline_flags(folder: Path) -> list[dict]:
    from megatron_slim.megatron.launch.flags import recipe_to_megatron_args

    argv = recipe_to_megatron_args(_megatron_baseline(folder).recipe) + [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
    ]
    return [{"name": "baseline", "world_size": 8, "argv": argv}]


@flag_group
def offload_flags(folder: Path) -> list[dict]:
    from megatron_slim.plan.recompute import OFFLOAD_RATIOS

    base = ["schedule.kind=slimpipe", "schedule.num_slices=2"]
    block = ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=2"]
    return [
        {
            "name": f"{ratio} {'block' if extra else 'none'}",
            "world_size": 64,
            "argv": _variant_flags("llama2-7b-64k", [*base, *extra, f"train.offload_ratio={ratio}"]),
            "report": ["slimpipe_offload_ratio", "use_slimpipe", "recompute_method"],
        }
        for ratio in OFFLOAD_RATIOS
        if ratio
        for extra in ([], block)
    ]


# the group each test checks (a tag parses the groups of the tests this session runs, no others)
TEST_GROUPS = {
    "test_every_shipped_recipe_command_passes_megatrons_parser_and_validation": "shipped_recipe_flags",
    "test_every_recompute_choice_passes_megatrons_parser_and_validation": "recompute_flags",
    "test_the_autotuners_megatron_baseline_with_cp_passes_megatrons_parser_and_validation": "baseline_flags",
    "test_every_offload_ratio_passes_megatrons_parser_and_validation_and_reads_back": "offload_flags",
    "test_start_up_checks_run_after_megatrons_validation": "start_up_flags",
}


@pytest.fixture(scope="module")
def parsed(request, tmp_path_factory):
    """``parsed(tag, group)``: each flag set of ``group`` (by name) as ``tag``'s parser saw it."""
    folder = tmp_path_factory.mktemp("flag-sets")
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    groups = {TEST_GROUPS[name] for name in selected if name in TEST_GROUPS}
    by_tag: dict[str, dict[str, dict]] = {}

    def results(tag: str, group: str) -> dict[str, dict]:
        assert group in groups, f"{group}: no selected test asked for it"
        if tag not in by_tag:
            sets = [{**s, "name": f"{g}:{s['name']}"} for g in sorted(groups) for s in FLAG_GROUPS[g](folder)]
            (folder / tag).mkdir()
            flat = _parse(tag, sets, folder / tag)
            by_tag[tag] = {g: {} for g in groups}
            for name, result in flat.items():
                g, _, own = name.partition(":")
                by_tag[tag][g][own] = result
        return by_tag[tag][group]

    results.folder = folder
    return results


def _failed(results: dict[str, dict]) -> dict[str, str]:
    return {n: r["error"] for n, r in results.items() if not r.get("ok")}


@pytest.mark.smoke
@pytest.mark.parametrize("tag", [_tag_param(t) for t in ALL_TAGS])
def test_every_shipped_recipe_command_passes_megatrons_parser_and_validation(tag, parsed):
    results = parsed(tag, "shipped_recipe_flags")
    assert not _failed(results), _failed(results)
    assert "llama2-70b-512k" in results


@pytest.mark.parametrize("tag", [_tag_param(t) for t in ALL_TAGS])
def test_every_recompute_choice_passes_megatrons_parser_and_validation(tag, parsed):
    assert any("--recompute-modules" in f["argv"] for f in recompute_flags(parsed.folder))
    results = parsed(tag, "recompute_flags")
    assert len(results) == len(recompute_flags(parsed.folder)) and not _failed(results), _failed(results)


@pytest.mark.parametrize("tag", [_tag_param(t) for t in ALL_TAGS])
def test_the_autotuners_megatron_baseline_with_cp_passes_megatrons_parser_and_validation(tag, parsed):
    """The chosen Megatron baseline at cp > 1 with sequence parallelism (Megatron-LM's own CP,
    ``cp.engine=megatron``), as ``megatron-args`` writes it, plus mock data."""
    best = _megatron_baseline(parsed.folder)
    assert best is not None and best.recipe.parallel.sequence_parallel
    result = parsed(tag, "baseline_flags")["baseline"]
    assert result.get("ok"), (best.label, result)


@pytest.mark.parametrize("tag", [_tag_param(t) for t in ALL_TAGS])
def test_every_offload_ratio_passes_megatrons_parser_and_validation_and_reads_back(tag, parsed):
    """``train.offload_ratio`` of a SlimPipe recipe as ``megatron-args`` spells it
    (``--slimpipe-offload-ratio``), alone and beside block recomputation: the launcher's parsed
    namespace holds the ratio, and the recipe it stands for has it again."""
    assert all("--slimpipe-offload-ratio" in f["argv"] for f in offload_flags(parsed.folder))
    results = parsed(tag, "offload_flags")
    assert len(results) == len(offload_flags(parsed.folder)) and not _failed(results), _failed(results)
    for name, result in results.items():
        ratio, recompute = name.split()
        assert result["values"]["slimpipe_offload_ratio"] == float(ratio) and result["values"]["use_slimpipe"]
        assert result["values"]["recompute_method"] == (None if recompute == "none" else "block")


BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "160",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--eval-interval",
    "4",
    "--eval-iters",
    "0",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--disable-bias-linear",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--lr",
    "0.5",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
SLIMPIPE = ["--use-slimpipe", "--slimpipe-num-slices", "4"]
SLICED_ZEPPELIN = ["--use-slimpipe", "--slimpipe-num-slices", "2", "--context-parallel-size", "2"]
SLICED_ZEPPELIN += ["--cp-engine", "zeppelin", "--slimpipe-hardware", "cpu"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
OFFLOAD = ["--slimpipe-offload-ratio", "0.5"]
ACCEPTED = {
    "dynmo-profile-and-freeze": (1, ["--dynmo-profile", "--dynmo-profile-smoothing", "0.3", "--dynmo-freeze", "2:0-1"]),
    "dynmo-early-exit": (1, ["--dynmo-exit-threshold", "0.5", "--dynmo-exit-from-layer", "2"]),
    "dynmo-mixture-of-depths": (2, ["--dynmo-mod-capacity", "0.5", "--pipeline-model-parallel-size", "2"]),
    "interleaved-slimpipe": (
        8,
        SLIMPIPE
        + ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "8"],
    ),
    "slimpipe-pp2": (2, SLIMPIPE + ["--pipeline-model-parallel-size", "2"]),
    "slimpipe-full-recompute": (2, SLIMPIPE + ["--pipeline-model-parallel-size", "2"] + FULL_RECOMPUTE),
    "slimpipe-slices-under-zeppelin": (2, SLICED_ZEPPELIN + ["--reset-position-ids", "--reset-attention-mask"]),
    "slimpipe-offload": (2, SLIMPIPE + ["--pipeline-model-parallel-size", "2"] + OFFLOAD),
    "slimpipe-offload-under-cp": (2, SLIMPIPE + ["--context-parallel-size", "2"] + OFFLOAD),
    "slimpipe-recompute-under-query-out-cp": (2, SLIMPIPE + ["--context-parallel-size", "2"] + FULL_RECOMPUTE),
    "cp-engine-zeppelin": (
        2,
        [
            "--context-parallel-size",
            "2",
            "--cp-engine",
            "zeppelin",
            "--cp-remap",
            "--reset-position-ids",
            "--reset-attention-mask",
            "--slimpipe-hardware",
            "cpu",
        ],
    ),
}
REJECTED = {
    "uneven-slices": (
        1,
        ["--use-slimpipe", "--slimpipe-num-slices", "3"],
        "--slimpipe-num-slices 3: --seq-length 32 does not split",
    ),
    "slices-without-slimpipe": (1, ["--slimpipe-num-slices", "4"], "--slimpipe-num-slices: needs --use-slimpipe"),
    "document-masking": (1, SLIMPIPE + ["--reset-attention-mask"], "drop --reset-attention-mask"),
    "cp-engine-under-slimpipe-remap": (
        2,
        SLICED_ZEPPELIN + ["--cp-remap"],
        "SlimPipe slices follow a CP engine's plan of each window for --cp-engine zeppelin | ring | ulysses with "
        "--virtual-pipeline-model-parallel-size=1",
    ),
    "slice-alignment": (
        4,
        [
            "--use-slimpipe",
            "--slimpipe-num-slices",
            "2",
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--seq-length",
            "36",
            "--max-position-embeddings",
            "36",
        ],
        "SlimPipe slice boundaries are multiples of 8 tokens",
    ),
    "recompute-on-a-cp-engines-slices": (
        2,
        SLICED_ZEPPELIN + ["--reset-position-ids", "--reset-attention-mask"] + FULL_RECOMPUTE,
        "not on a CP engine's plans; allowed: drop --cp-engine",
    ),
    "offload-without-slimpipe": (1, OFFLOAD, "--slimpipe-offload-ratio: got 0.5 without --use-slimpipe"),
    "offload-out-of-range": (
        1,
        SLIMPIPE + ["--slimpipe-offload-ratio", "1.5"],
        "--slimpipe-offload-ratio: got 1.5; allowed: a fraction in [0, 1]",
    ),
    "offload-under-full-uniform-recompute": (
        1,
        SLIMPIPE + FULL_RECOMPUTE + OFFLOAD,
        "every layer keeps only its checkpoint input, so no layer keeps activations to offload",
    ),
    "remap-without-zeppelin": (1, ["--cp-remap"], "--cp-remap: only with --cp-engine zeppelin"),
    "dynmo-early-exit-beside-mixture-of-depths": (
        1,
        ["--dynmo-exit-threshold", "0.5", "--dynmo-mod-capacity", "0.5"],
        "--dynmo-exit-threshold: got 0.5 with --dynmo-mod-capacity 0.5; allowed: 0 (off) beside it",
    ),
    "dynmo-mixture-of-depths-under-tp": (
        2,
        ["--dynmo-mod-capacity", "0.5", "--tensor-model-parallel-size", "2"],
        "--dynmo-mod-capacity: got 0.5 with --tensor-model-parallel-size 2; allowed: 0 (off) beside it",
    ),
    "dynmo-freeze-past-the-model": (1, ["--dynmo-freeze", "2:3-4"], "layers in [0, --num-layers-1=3]"),
    "dynmo-profile-with-recompute": (
        1,
        ["--dynmo-profile", *FULL_RECOMPUTE],
        "--dynmo-profile: got it with --recompute-granularity full",
    ),
    "cp-engine-without-cp": (1, ["--cp-engine", "ring"], "needs --context-parallel-size > 1"),
}


STARTUP_CASES = {**{k: (w, f, None) for k, (w, f) in ACCEPTED.items()}, **REJECTED}


@flag_group
def start_up_flags(folder: Path) -> list[dict]:
    return [
        {"name": name, "world_size": world, "argv": BASE + flags} for name, (world, flags, _) in STARTUP_CASES.items()
    ]


@pytest.mark.smoke
@pytest.mark.parametrize("tag", [_tag_param(t) for t in ALL_TAGS])
def test_start_up_checks_run_after_megatrons_validation(tag, parsed):
    cases = STARTUP_CASES
    results = parsed(tag, "start_up_flags")
    for name, (_, _, needle) in cases.items():
        if needle is None:
            assert results[name].get("ok"), (name, results[name])
        else:
            assert needle in results[name].get("error", ""), (name, results[name])
            assert results[name]["error"].startswith("ConfigError"), (name, results[name])


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_the_optional_patch_applies_to_every_tag_without_fuzz(tag, tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_bytes((tags_dir() / tag / "pretrain_gpt.py").read_bytes())
    done = subprocess.run(
        [
            "patch",
            "--fuzz=0",
            "--batch",
            "-p1",
            "-d",
            str(tmp_path),
            "-i",
            str(REPO / "patches" / "pretrain_gpt.patch"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "fuzz" not in done.stdout.lower(), done.stdout + done.stderr
    assert "prepare_launch()" in script.read_text()
    compile(script.read_text(), str(script), "exec")


def test_every_group_has_its_test():
    assert set(TEST_GROUPS.values()) == set(FLAG_GROUPS)
    assert all(callable(globals().get(name)) for name in TEST_GROUPS)

"""``megatron-slim megatron-args``: the flags of a recipe, as one shell line or one flag per line."""

import shlex

import pytest

from megatron_slim.cli import main
from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe


@pytest.mark.parametrize("recipe", ["llama2-7b-64k", "zeppelin-7b-h800", "tiny-cpu"])
def test_lines_format_prints_one_flag_per_line_with_its_values(recipe, capsys):
    assert main(["megatron-args", "--recipe", recipe, "--format", "lines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = recipe_to_megatron_args(load_recipe(recipe))
    assert [w for line in lines for w in shlex.split(line)] == expected
    for line in lines:
        words = shlex.split(line)
        assert words[0].startswith("--") and not any(w.startswith("--") for w in words[1:])
    assert "--num-layers" in [shlex.split(line)[0] for line in lines]
    assert lines.count("--swiglu") == 1


def test_lines_format_shell_quotes_values(capsys):
    from megatron_slim.commands.megatron_args import flag_lines

    assert flag_lines(["--num-layers", "32", "--name", "a b", "--swiglu"]) == [
        "--num-layers 32",
        "--name 'a b'",
        "--swiglu",
    ]


def test_shell_format_round_trips(capsys):
    assert main(["megatron-args", "--recipe", "llama2-7b-64k"]) == 0
    assert shlex.split(capsys.readouterr().out) == recipe_to_megatron_args(load_recipe("llama2-7b-64k"))


def test_an_override_that_changes_the_gpu_count_is_noted_on_stderr(capsys):
    assert main(["megatron-args", "--recipe", "llama2-7b-64k", "--set", "parallel.pp=8", "--nodes"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "16"  # stdout stays machine-readable
    assert "note: --set parallel.pp=8 changes the job from 64 to 128 GPUs (tp4 pp8 cp1 dp4)" in captured.err
    assert main(["megatron-args", "--recipe", "llama2-7b-64k", "--set", "parallel.pp=2", "parallel.dp=8"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_flags_megatron_would_reject_inside_its_loop_are_refused_or_always_emitted(capsys):
    """Megatron asserts warmup < train iterations at start-up, needs --save-interval with --save and
    --eval-interval always, and builds an s x s mask per sample unless told not to."""
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", "train.iters=2"]) == 2
    assert "train.warmup_iters: got 10 with train.iters=2" in capsys.readouterr().err
    flags = recipe_to_megatron_args(load_recipe("llama2-7b-64k"))
    for flag in ("--save-interval", "--eval-interval", "--eval-iters", "--no-create-attention-mask-in-dataloader"):
        assert flag in flags
    recipe = load_recipe("llama2-7b-64k")
    assert flags[flags.index("--save-interval") + 1] == str(recipe.train.save_interval)
    assert flags[flags.index("--eval-interval") + 1] == str(recipe.train.eval_interval)


def test_an_uneven_pipeline_split_is_refused_for_megatron_launches(capsys):
    """Megatron-LM sets only the first and last stage's layer counts; `megatron-slim train` runs any split."""
    sets = ["parallel.pp=4", "parallel.layers_per_stage=[8,8,8,8]"]
    even = recipe_to_megatron_args(load_recipe("llama2-7b-64k", sets))
    assert even == recipe_to_megatron_args(load_recipe("llama2-7b-64k", ["parallel.pp=4"]))
    sets = ["parallel.pp=4", "parallel.layers_per_stage=[11,7,7,7]"]
    assert main(["megatron-args", "--recipe", "llama2-7b-64k", "--set", *sets]) == 2
    err = capsys.readouterr().err
    assert "parallel.layers_per_stage" in err and "uneven splits run under `megatron-slim train`" in err


def test_offload_becomes_the_slimpipe_offload_flag_and_reads_back(capsys):
    """``train.offload_ratio`` of a SlimPipe recipe is ``--slimpipe-offload-ratio``; megatron-slim's
    parser reads it back into the start-up rules' settings and the launcher's recipe."""
    import argparse

    from megatron_slim.megatron.launch.args import settings_from_megatron_args
    from megatron_slim.megatron.launch.flags import add_arguments
    from megatron_slim.megatron.launch.recompute_flags import recompute_from_megatron_args

    sliced = ["schedule.kind=slimpipe", "schedule.num_slices=2"]
    block = ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=1"]
    for extra in ([], block):
        flags = recipe_to_megatron_args(load_recipe("tiny-cpu", [*sliced, *extra, "train.offload_ratio=0.25"]))
        assert flags[flags.index("--slimpipe-offload-ratio") + 1] == "0.25"
        args, _ = add_arguments(argparse.ArgumentParser()).parse_known_args(flags)
        assert args.slimpipe_offload_ratio == 0.25 and settings_from_megatron_args(args).offload_ratio == 0.25
        assert recompute_from_megatron_args(args)["offload_ratio"] == 0.25
    assert "--slimpipe-offload-ratio" not in recipe_to_megatron_args(load_recipe("tiny-cpu", sliced))

    one_f_one_b = ["schedule.kind=1f1b", "schedule.num_slices=1", "train.offload_ratio=0.5"]
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", *one_f_one_b]) == 2
    err = capsys.readouterr().err
    assert "train.offload_ratio: got 0.5 without schedule.kind=slimpipe" in err
    assert "allowed: schedule.kind=slimpipe, or train.offload_ratio=0" in err
    full_uniform = [*sliced, "train.recompute=full", "train.offload_ratio=0.5"]
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", *full_uniform]) == 2
    err = capsys.readouterr().err
    assert "no layer keeps activations to offload" in err and "train.recompute_method=block" in err

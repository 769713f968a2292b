"""Inputs a user can get wrong fail before any work with one line naming the field or flag, the
value and what is allowed (issue 8's list): non-physical numbers, unreadable or ambiguous files,
flags that were silently ignored."""

import pytest

from megatron_slim.cli import main


def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(f"megatron-slim {argv[0]}: error: "), err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model.rotary_base=0", "model.rotary_base: invalid value (got 0.0; allowed: a number > 1"),
        ("model.rotary_base=-5", "model.rotary_base"),
        ("model.norm_epsilon=-1e-5", "model.norm_epsilon: invalid value (got -1e-05; allowed: a number in (0, 1)"),
        ("train.lr=inf", "train.lr: invalid value (got 'inf'; allowed: a finite number)"),
        ("train.clip_grad=nan", "train.clip_grad: invalid value (got 'nan'; allowed: a finite number)"),
        ("train.min_lr=-inf", "train.min_lr: invalid value (got '-inf'; allowed: a finite number)"),
        ("train.weight_decay=-0.1", "train.weight_decay: invalid value (got -0.1; allowed: a number >= 0)"),
        ("train.seed=-1", "train.seed: invalid value (got -1; allowed: an integer in [0, 4294967295]"),
        ("train.seed=4294967296", "train.seed: invalid value (got 4294967296; allowed: an integer in [0, 4294967295]"),
        ("data.max_files=-1", "data.max_files: invalid value (got -1; allowed: an integer >= 0"),
    ],
)
def test_non_physical_values_are_refused(capsys, override, expected):
    assert expected in _error(capsys, "simulate", "--recipe", "tiny-cpu", "--set", override)


def test_a_recipe_that_is_not_utf8_or_repeats_a_key_is_refused(tmp_path, capsys):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("description: caf\xe9\n".encode("latin-1"))
    assert "not UTF-8 text (byte 0xe9 at line 1" in _error(capsys, "simulate", "--recipe", str(latin1))
    twice = tmp_path / "twice.yaml"
    twice.write_text("hardware: cpu\nmodel: {num_layers: 2}\nhardware: h100\n")
    assert "key 'hardware' appears twice (lines 1 and 3)" in _error(capsys, "simulate", "--recipe", str(twice))


def test_a_recipe_with_yaml_aliases_or_of_megabytes_is_refused_before_it_is_expanded(tmp_path, capsys):
    """Nested aliases (a "billion laughs" of 1.2 KB) would need gigabytes to expand; refused unread."""
    laughs = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"{n}: &{n} [{', '.join(['*' + p] * 10)}]" for p, n in zip("abcdefgh", "bcdefghi")]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(laughs) + "\n")
    err = _error(capsys, "simulate", "--recipe", str(bomb))
    assert f"--recipe {bomb}: not valid YAML at line 2, column 8: alias *a; allowed: no anchors or aliases" in err
    huge = tmp_path / "huge.yaml"
    huge.write_text("description: " + "x" * (1 << 20) + "\n")
    err = _error(capsys, "simulate", "--recipe", str(huge))
    assert f"--recipe {huge}: {(1 << 20) + 14} bytes of YAML; allowed: at most {1 << 20} bytes" in err


def test_a_hardware_profile_that_is_malformed_or_not_utf8_is_refused(tmp_path, capsys):
    for name, content, expected in (
        ("broken.yaml", b"name: [unclosed\n", "not valid YAML"),
        ("latin1.yaml", b"name: x\xff\n", "not UTF-8 text"),
        ("twice.yaml", b"name: a\nname: b\n", "key 'name' appears twice"),
    ):
        path = tmp_path / name
        path.write_bytes(content)
        err = _error(capsys, "simulate", "--recipe", "tiny-cpu", "--set", f"hardware={path}")
        assert f"hardware {path}: " in err and expected in err


def test_calibration_and_lengths_files_that_are_not_utf8_or_repeat_keys_are_refused(tmp_path, capsys):
    calibration = tmp_path / "cal.yaml"
    calibration.write_text("hardware: cpu\nhardware: h100\n")
    assert "key 'hardware' appears twice" in _error(
        capsys, "simulate", "--recipe", "tiny-cpu", "--calibration", str(calibration)
    )
    calibration.write_bytes(b"hardware: \xff\n")
    assert "not UTF-8 text" in _error(capsys, "simulate", "--recipe", "tiny-cpu", "--calibration", str(calibration))
    lengths = tmp_path / "lengths.txt"
    lengths.write_bytes(b"100\n\xff\n")
    err = _error(capsys, "simulate", "--recipe", "zeppelin-7b-h800", "--cp-engine", "ring", "--lengths", str(lengths))
    assert f"--lengths {lengths}: not UTF-8 text (byte 0xff at line 2" in err


def test_flags_that_were_silently_ignored_are_refused(capsys):
    error = _error(capsys, "simulate", "--recipe", "tiny-cpu", "--compare", ",")
    assert "--compare ',': an empty schedule name" in error
    assert "--compare '1f1b,': an empty" in _error(capsys, "simulate", "--recipe", "tiny-cpu", "--compare", "1f1b,")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--exit-interval", "-1"])
    assert exit_.value.code == 2
    assert "--exit-interval: got '-1'; allowed: an integer >= 1" in capsys.readouterr().err


@pytest.mark.single
def test_an_exit_interval_the_run_never_reaches_is_refused(tmp_path, capsys):
    err = _error(capsys, "train", "--set", "train.iters=3", "--exit-interval", "4")
    assert "--exit-interval 4: this run trains iterations 1..3; allowed: 1..3" in err


@pytest.mark.single
def test_an_exit_interval_before_the_resumed_iteration_is_refused(tmp_path, capsys):
    import json

    from megatron_slim.plan.recipe import load_recipe
    from megatron_slim.train.checkpoint.layout import iteration_dir, write_manifest

    ckpt = tmp_path / "ckpt"
    folder = iteration_dir(ckpt, 3)  # an intact (checksummed) iteration 3, weights aside
    folder.mkdir(parents=True)
    (folder / "recipe.json").write_text(json.dumps(load_recipe("tiny-cpu").to_dict()))
    write_manifest(folder, 3)
    (ckpt / "latest").write_text("3\n")
    err = _error(capsys, "train", "--checkpoint-dir", str(ckpt), "--exit-interval", "2")
    assert (
        "--exit-interval 2: this run trains iterations 4..40 (it resumes from the checkpoint at iteration 3); "
        "allowed: 4..40"
    ) in err


def test_megatron_args_refuses_the_seed_megatron_rejects_at_start_up(capsys):
    err = _error(capsys, "megatron-args", "--recipe", "tiny-cpu", "--set", "train.seed=0")
    assert "train.seed: got 0; Megatron-LM needs a positive seed; allowed: an integer in [1, 4294967295]" in err


@pytest.mark.single
def test_train_checks_its_data_source_before_any_work(tmp_path, capsys):
    missing = tmp_path / "no-such-corpus"
    assert f"data.corpus: '{missing}' is not a directory" in _error(capsys, "train", "--set", f"data.corpus={missing}")
    assert "model.vocab_size: got 100; the tokenizer trained on the corpus needs" in _error(
        capsys, "train", "--set", "model.vocab_size=100"
    )


@pytest.mark.single
def test_megatron_args_emits_no_recompute_the_slimpipe_launcher_would_refuse(capsys):
    under_cp = ["train.recompute=full", "parallel.cp=2", "parallel.pp=1"]
    err = _error(capsys, "megatron-args", "--recipe", "tiny-cpu", "--set", *under_cp, "cp.engine=zeppelin")
    assert "train.recompute: got 'full' with schedule.kind=slimpipe, parallel.cp=2 and cp.engine=zeppelin" in err
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", *under_cp, "cp.engine=ring"]) == 0
    assert "--cp-engine" not in (out := capsys.readouterr().out) and "--recompute-granularity full" in out
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", "train.recompute=full"]) == 0
    assert "--use-slimpipe" in (out := capsys.readouterr().out) and "--recompute-granularity full" in out
    assert (
        main(
            [
                "megatron-args",
                "--recipe",
                "tiny-cpu",
                "--set",
                "train.recompute=full",
                "schedule.kind=1f1b",
                "schedule.num_slices=1",
            ]
        )
        == 0
    )
    assert "--recompute-granularity full" in capsys.readouterr().out
    layernorm = ["train.recompute=selective", "train.recompute_modules=core_attn,layernorm"]
    assert "train.recompute_modules: got ['core_attn', 'layernorm']; the CPU training loop runs" in _error(
        capsys, "train", "--set", *layernorm
    )
    assert "allowed: a list of core_attn, mlp" in _error(capsys, "train", "--set", *layernorm)
    under_cp = ["parallel.pp=1", "parallel.cp=2", "schedule.num_slices=1", "train.offload_ratio=0.5"]
    assert "or train.recompute=none and train.offload_ratio=0" in _error(capsys, "train", "--set", *under_cp)


ENGINES = "'ring' | 'zeppelin' | 'ulysses' | 'a2a+p2p' | 'allgather' | 'dynamic' | 'megatron'"
MEGATRON_CP = ["parallel.cp=2", "parallel.dp=1", "schedule.kind=1f1b", "schedule.num_slices=1", "cp.engine=megatron"]


def test_an_unknown_cp_engine_is_refused_with_every_engine_a_recipe_may_name(capsys):
    err = _error(capsys, "simulate", "--recipe", "tiny-cpu", "--set", "cp.engine=te")
    assert f"cp.engine: invalid value (got 'te'; allowed: {ENGINES})" in err


@pytest.mark.parametrize(
    "argv,expected",
    [
        # train's CPU ranks build megatron-core's local attention, which refuses cp > 1
        (
            ["train", "--recipe", "tiny-cpu", "--set", *MEGATRON_CP],
            "cp.engine: Megatron-LM's own context parallelism runs in Transformer Engine on GPUs; "
            "megatron-core's local attention, which megatron-slim train's CPU ranks build, refuses parallel.cp > 1 "
            "(got 'megatron'; allowed: ring | zeppelin | ulysses | a2a+p2p | allgather | dynamic with parallel.cp=2, "
            "or parallel.cp=1",
        ),
        # SlimPipe's slices read a K/V cache Megatron-LM's CP attention has no way to read
        (
            ["megatron-args", "--recipe", "tiny-cpu", "--set", "parallel.cp=2", "parallel.dp=1", "cp.engine=megatron"],
            "cp.engine: invalid value (got 'megatron'; allowed: one of zeppelin, ring, ulysses",
        ),
        (
            ["megatron-args", "--recipe", "tiny-cpu", "--set", *MEGATRON_CP, "cp.remap=true"],
            "cp.remap: invalid value (got True; allowed: false with cp.engine=megatron",
        ),
        # no per-pack placement to simulate, whether named on the command line or by the recipe
        (
            ["simulate", "--recipe", "tiny-cpu", "--cp-engine", "megatron", "--lengths", "fixed:length=64"],
            "--cp-engine: megatron (Megatron-LM's own CP) attends each window as one causal sequence",
        ),
        (
            ["simulate", "--recipe", "tiny-cpu", "--set", *MEGATRON_CP, "--lengths", "fixed:length=64"],
            "allowed: zeppelin | ring | ulysses | a2a+p2p | allgather | dynamic (ring: Transformer Engine's p2p ring",
        ),
    ],
    ids=["train", "slimpipe", "remap", "simulate-cp-engine", "simulate-recipe-engine"],
)
def test_megatrons_own_cp_is_refused_where_it_cannot_run(capsys, argv, expected):
    assert expected in _error(capsys, *argv)


def test_megatrons_own_cp_is_launched_as_megatron_lm_runs_it(capsys):
    """``--context-parallel-size`` alone: no megatron-slim engine, no document resets, no hardware flag."""
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", *MEGATRON_CP]) == 0
    flags = capsys.readouterr().out.split()
    assert flags[flags.index("--context-parallel-size") + 1] == "2"
    assert not {"--cp-engine", "--cp-remap", "--reset-position-ids", "--reset-attention-mask"} & set(flags)
    assert "--slimpipe-hardware" not in flags

"""`python -m megatron_slim.launch pretrain_gpt.py ...` against a stand-in of Megatron-LM's training
package (see tests/megatron/standin/README.md): flags registered, layer spec and schedule replaced,
training runs on CPU gloo ranks; unsupported combinations rejected at start-up."""
from megatron_slim.runtime.spawn import run_ranks
from tests.megatron import _launch_workers

BASE = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "160", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32",
        "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights", "--lr", "0.5"]


def test_launcher_runs_slimpipe_with_slice_attention_and_a_falling_loss():
    flags = BASE + ["--use-slimpipe", "--slimpipe-num-slices", "4", "--slimpipe-slice-policy", "balanced",
                    "--slimpipe-hardware", "cpu"]
    results = run_ranks(_launch_workers.launch, 2, flags, timeout_s=300)
    for r in results:
        assert r["functions"] == ["forward_backward_slimpipe"] * 4
        assert r["attentions"] and all(a == "SliceCoreAttention" for a in r["attentions"]) and r["all_slice"]
    losses = results[1]["losses"]  # the last pipeline stage reports
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert results[0]["losses"] == []


REJECTED = [
    (["--use-slimpipe", "--slimpipe-num-slices", "3"], "--slimpipe-num-slices 3: --seq-length 32 does not split"),
    (["--use-slimpipe", "--slimpipe-num-slices", "4", "--overlap-p2p-comm"], "drop --overlap-p2p-comm"),
    (["--slimpipe-num-slices", "4"], "--slimpipe-num-slices: needs --use-slimpipe"),
    (["--use-slimpipe", "--slimpipe-num-slices", "2", "--num-experts", "8"], "does not support MoE"),
    (["--use-slimpipe", "--slimpipe-num-slices", "2", "--context-parallel-size", "2", "--cp-engine", "zeppelin"],
     "--use-slimpipe brings its own context-parallel attention"),
    (["--use-slimpipe", "--slimpipe-num-slices", "2", "--context-parallel-size", "2", "--seq-length", "30",
      "--max-position-embeddings", "30"], "SlimPipe slice boundaries are multiples of 4 tokens"),
    (["--cp-remap"], "--cp-remap: only with --cp-engine zeppelin"),
]


def test_unsupported_flag_combinations_fail_at_start_up():
    single = [("1" if prev == "--pipeline-model-parallel-size" else f) for prev, f in zip([""] + BASE, BASE)]
    results = run_ranks(_launch_workers.launch_many, 1, [single + extra for extra, _ in REJECTED], timeout_s=180)
    for (extra, needle), result in zip(REJECTED, results[0]):
        assert needle in result.get("error", ""), (extra, result)


def test_public_entry_points_are_functions():
    import megatron_slim.megatron as m
    from megatron_slim.megatron import hooks  # noqa: F401 - importing the submodule must not shadow install()

    assert callable(m.install) and callable(m.add_arguments)


def test_every_shipped_recipe_passes_the_start_up_checks():
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"sys.path.insert(0, {_launch_workers.STANDIN!r})\n"
        "from megatron.training.arguments import parse_args\n"
        "from megatron_slim.megatron.flags import add_arguments, check_megatron_args, recipe_to_megatron_args\n"
        "from megatron_slim.plan.recipe import available_recipes, load_recipe\n"
        "for name in available_recipes():\n"
        "    sys.argv = ['pretrain_gpt.py'] + recipe_to_megatron_args(load_recipe(name))\n"
        "    check_megatron_args(parse_args(add_arguments, ignore_unknown_args=True))\n"
        "    print(name)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "llama2-70b-512k" in run.stdout.split()

"""A nan/inf loss or gradient norm stops ``megatron-slim train`` with a named error and exit code 3
before the update (Megatron's --check-for-nan-in-loss-and-grad), unless train.skip_nonfinite_steps
asks to skip such steps, each of which is then printed and listed in the JSON."""

import copy
import json

import pytest
import torch

from megatron_slim.cli import main
from megatron_slim.commands.train import STOPPED_EXIT_CODE
from megatron_slim.train.step import clip_and_step, loss_is_finite
from tests.overrides import once_per_key
from tests.train.conftest import SMALL_DATA

# Adam moves every weight by about lr per step whatever the gradient: at lr=1e30 the second
# iteration's gradients overflow to nan while its loss is still finite.
EXPLODING = [
    "parallel.pp=2",
    "schedule.num_slices=2",
    "train.iters=4",
    "train.global_batch_size=2",
    "model.seq_length=128",
    "train.warmup_iters=0",
    "train.lr=1e30",
    "train.min_lr=0",
]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # some optimizer state to keep
    scheduler.step()
    return model, optimizer, scheduler


@pytest.mark.parametrize("poison", ["grad", "loss"])
def test_a_nonfinite_step_changes_nothing(poison):
    model, optimizer, scheduler = _model_and_optimizer()
    model(torch.randn(2, 4)).sum().backward()
    if poison == "grad":
        model.weight.grad[0, 0] = float("nan")
    finite = loss_is_finite([{"lm loss": torch.tensor([float("nan") if poison == "loss" else 1.0, 4.0])}])
    assert finite == (poison == "grad")
    params, state = copy.deepcopy(list(model.parameters())), copy.deepcopy(optimizer.state_dict())
    lr = optimizer.param_groups[0]["lr"]
    stepped, _ = clip_and_step(list(model.parameters()), optimizer, scheduler, 1.0, None, 0, finite)
    assert not stepped
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert str(optimizer.state_dict()) == str(state) and optimizer.param_groups[0]["lr"] == lr
    assert loss_is_finite([]) and loss_is_finite([{"lm loss": torch.tensor([2.0, 4.0])}])


def _run(tmp_path, capfd, *sets):
    out = tmp_path / "train.json"
    code = main(["train", "--set", *once_per_key(*SMALL_DATA, *EXPLODING, *sets), "--json", str(out)])
    return code, json.loads(out.read_text()), capfd.readouterr()


@pytest.mark.multi
def test_a_nan_gradient_norm_stops_training_with_a_named_error(tmp_path, capfd):
    code, payload, captured = _run(tmp_path, capfd)
    assert code == STOPPED_EXIT_CODE == 3
    assert "megatron-slim train: error: iteration 2: the gradient norm (nan) is not finite" in captured.err
    assert "train.skip_nonfinite_steps=true" in captured.err
    assert payload["stopped"].startswith("iteration 2:") and payload["loss_iterations"] == [1]


@pytest.mark.multi
def test_skipping_nonfinite_steps_is_opt_in_and_says_so_every_time(tmp_path, capfd):
    code, payload, captured = _run(tmp_path, capfd, "train.skip_nonfinite_steps=true")
    assert code == 0 and payload["stopped"] is None
    assert payload["skipped_iterations"] == [2, 3, 4] and payload["skipped_steps"] == 3
    assert captured.out.count("(skipped: not finite)") == 3


def test_megatron_args_refuses_skipping_which_megatron_cannot_do(capfd):
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", "train.skip_nonfinite_steps=true"]) == 2
    assert "train.skip_nonfinite_steps: got true; Megatron-LM cannot skip" in capfd.readouterr().err

"""The benchmark's activation measurement (``shim/activation_recorder.py``) counts what it says it
counts: on small autograd graphs whose saved tensors are known byte for byte. No Megatron run."""

from __future__ import annotations

import gc
import importlib.util
import json
import threading
import types

import pytest
import torch

from tests.real_megatron.harness import SHIM


def _load():
    spec = importlib.util.spec_from_file_location("activation_recorder_under_test", SHIM / "activation_recorder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recorder = _load()


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_counts_saved_inputs_and_outputs_but_not_parameters_and_releases_after_backward():
    w = torch.nn.Parameter(torch.randn(16, 32))
    counter = recorder.SavedActivationCounter([w])
    x = torch.randn(4, 16, requires_grad=True)  # a leaf that requires grad, like a stage's received input
    with counter:
        y = x @ w  # saves x (counted) and w (a parameter: not counted)
        z = y.exp()  # saves its output z
        loss = (z * 2).sum()  # a Python-scalar multiply and a sum save nothing
    assert counter.saved_tensors == 3
    assert counter.live_bytes == _nbytes(x) + _nbytes(z) == 4 * 16 * 4 + 4 * 32 * 4
    assert counter.peak_bytes == counter.live_bytes
    loss.backward()
    assert counter.live_bytes == 0
    assert counter.peak_bytes == 4 * 16 * 4 + 4 * 32 * 4
    assert torch.allclose(x.grad, (2 * z.detach()) @ w.detach().t())  # the hooks change nothing in the maths


def test_parameter_views_are_excluded_even_if_not_listed():
    w = torch.nn.Parameter(torch.randn(8, 8))
    counter = recorder.SavedActivationCounter()
    x = torch.randn(2, 8, requires_grad=True)
    with counter:
        out = x @ w.t()  # saves x and a view of the parameter
    assert counter.saved_tensors == 2 and counter.live_bytes == _nbytes(x) == 2 * 8 * 4
    del out


def test_one_storage_counts_once_and_until_its_last_slot_goes():
    counter = recorder.SavedActivationCounter()
    a = torch.randn(8, 8, requires_grad=True)
    with counter:
        h = a.exp()  # saves its output h: 256 bytes (a itself is not saved)
        left = h[:4] * h[4:]  # saves two views of h's storage
        right = h.sin()  # saves h again
    assert counter.saved_tensors == 4
    assert counter.live_bytes == 8 * 8 * 4
    left.sum().backward()  # frees left's slots and exp's, but sin's slot still holds h
    assert counter.live_bytes == 8 * 8 * 4
    del right  # a graph dropped unused releases at once (no gc needed)
    assert counter.live_bytes == 0
    gc.collect()
    assert counter.live_bytes == 0


def test_peak_is_the_maximum_of_live_bytes_not_the_sum_of_saves():
    counter = recorder.SavedActivationCounter()
    x = torch.randn(1024, requires_grad=True)
    with counter:
        y1, y2 = x.exp(), x.exp()  # 2 x 4 KiB live
        y1.sum().backward()  # 4 KiB
        y3 = x.exp()  # 8 KiB again
        y2.sum().backward()
        y3.sum().backward()
    assert counter.saved_tensors == 3 and counter.live_bytes == 0
    assert counter.peak_bytes == 2 * 4096
    counter.reset_peak()
    assert counter.peak_bytes == 0 and counter.saved_tensors == 0


def test_custom_function_saves_and_a_cache_alias_count_once():
    """Like megatron-slim's slice attention: ctx.save_for_backward(k) while a K/V cache keeps
    k.detach() (the same storage). That storage is activation memory and counts once."""
    cache = []

    class Attend(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k):
            cache.append(k.detach())
            ctx.save_for_backward(q, k)
            return q * k.sum()

        @staticmethod
        def backward(ctx, grad):
            q, k = ctx.saved_tensors
            return grad * k.sum(), (grad * q).sum().expand_as(k)

    q = torch.randn(64, requires_grad=True)
    k = torch.randn(32, requires_grad=True)
    counter = recorder.SavedActivationCounter()
    with counter:
        q1, k1 = q.exp(), k.exp()  # exp saves q1 and k1, the Function saves them again
        out = Attend.apply(q1, k1)
    assert counter.saved_tensors == 4
    assert counter.live_bytes == 64 * 4 + 32 * 4
    assert cache[0].untyped_storage().data_ptr() == k1.untyped_storage().data_ptr()
    out.sum().backward()
    assert counter.live_bytes == 0


def test_square_attention_matrices_are_tallied_apart():
    counter = recorder.SavedActivationCounter(square=16)
    q = torch.randn(2, 16, 4, requires_grad=True)
    with counter:
        scores = q @ q.transpose(1, 2)  # [2, 16, 16]; saves two views of q
        probs = scores.softmax(-1)  # saves probs: square
        out = probs @ q  # saves probs and q again
    assert counter.live_bytes == _nbytes(q) + _nbytes(probs) == 2 * 16 * 4 * 4 + 2 * 16 * 16 * 4
    assert counter.peak_sxs_bytes == _nbytes(probs)
    assert counter.peak_excl_sxs_bytes == _nbytes(q)
    del out


def test_hooks_are_thread_local_so_they_must_be_entered_on_the_forward_thread():
    counter = recorder.SavedActivationCounter()
    x = torch.randn(16, requires_grad=True)
    elsewhere = []
    with counter:
        thread = threading.Thread(target=lambda: elsewhere.append(x.exp()))
        thread.start()
        thread.join()
        assert counter.saved_tensors == 0
        y = x.exp()
    assert counter.saved_tensors == 1 and counter.live_bytes == 16 * 4
    elsewhere.clear()
    del y


def test_install_records_the_peak_of_each_iteration(tmp_path, monkeypatch):
    """Through the wrappers of Megatron's ``train`` / ``training_log``: parameters of every model
    chunk are excluded, each iteration's peak is its own, and nothing is left held after it."""
    monkeypatch.setenv("MEGATRON_SLIM_TEST_RECORD", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    model = torch.nn.Linear(8, 8, bias=False)

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        return None

    def train(forward_step_func, model, graphs_per_iteration):
        x = torch.randn(4, 8)  # the Linear saves it (128 bytes, one storage for every graph)
        for iteration, graphs in enumerate(graphs_per_iteration, start=1):
            alive = [model[0](x).exp() for _ in range(graphs)]  # each exp saves its output: 128 bytes
            sum(y.sum() for y in alive).backward()
            del alive
            training.training_log({}, {}, 0.1, iteration)

    training = types.SimpleNamespace(
        train=train, training_log=training_log, get_args=lambda: types.SimpleNamespace(seq_length=2048)
    )
    recorder.install(training)
    training.train(None, [model], [3, 1])
    records = [json.loads(line) for line in (tmp_path / "rank3.jsonl").read_text().splitlines()]
    assert [
        (r["kind"], r["iteration"], r["peak_bytes"], r["saved_tensors"], r["live_bytes_after"]) for r in records
    ] == [("activations", 1, 128 + 3 * 128, 6, 0), ("activations", 2, 128 + 128, 2, 0)]
    assert all(r["thread"] == "MainThread" and r["peak_sxs_bytes"] == 0 for r in records)


def test_install_refuses_an_iteration_with_nothing_saved(tmp_path, monkeypatch):
    """Another saved_tensors_hooks context inside (activation checkpointing, an inner meter)
    would shadow the recorder's: an iteration that saved nothing is an error, not a zero."""
    monkeypatch.setenv("MEGATRON_SLIM_TEST_RECORD", str(tmp_path))
    model = torch.nn.Linear(2, 2)

    def train(forward_step_func, model):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model[0](torch.randn(3, 2)).sum().backward()
        training.training_log({}, {}, 0.1, 1)

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration):
        return None

    training = types.SimpleNamespace(
        train=train, training_log=training_log, get_args=lambda: types.SimpleNamespace(seq_length=8)
    )
    recorder.install(training)
    with pytest.raises(RuntimeError, match="shadows"):
        training.train(None, [model])

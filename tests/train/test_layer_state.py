"""One layer's training state packed into one fp32 message and unpacked elsewhere: bit-exact, and
state that cannot travel is refused by name."""

import pytest
import torch

from megatron_slim.train.dynmo.layer_state import pack, packed_numel, state_problem, unpack


def _trained(shapes, steps=3, amsgrad=False, skip_grad=()):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    optimizer = torch.optim.AdamW(params, lr=0.1, amsgrad=amsgrad)
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = None if i in skip_grad else torch.randn(p.shape)
        optimizer.step()
    return params, optimizer


def test_pack_then_unpack_restores_weights_grads_and_adam_state_exactly():
    shapes = [(4, 3), (3,), (2, 2, 2)]
    params, optimizer = _trained(shapes, skip_grad=(1,))
    params[2].grad = None  # a parameter without a gradient now, with optimizer state
    flat = pack(params, optimizer)
    assert flat.numel() == packed_numel(params) == 3 * 3 + 4 * (12 + 3 + 8)
    fresh = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    other = torch.optim.AdamW(fresh, lr=0.1)
    unpack(flat, fresh, other)
    for old, new in zip(params, fresh):
        assert torch.equal(old.detach(), new.detach())
        assert (old.grad is None) == (new.grad is None)
        if old.grad is not None:
            assert torch.equal(old.grad, new.grad)
    assert fresh[1] not in other.state  # never had a gradient: no Adam state, none invented
    for old, new in ((params[0], fresh[0]), (params[2], fresh[2])):
        want, got = optimizer.state[old], other.state[new]
        assert set(got) == {"step", "exp_avg", "exp_avg_sq"} and got["step"].item() == want["step"].item() == 3
        assert torch.equal(got["exp_avg"], want["exp_avg"]) and torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
    with pytest.raises(ValueError, match="these parameters need"):
        unpack(flat[:-1], fresh, other)


def test_state_that_cannot_travel_is_refused_by_name():
    params, optimizer = _trained([(2,)], amsgrad=True)
    assert "allowed: ['exp_avg', 'exp_avg_sq', 'step'] (AdamW, amsgrad off)" in state_problem(params, optimizer)
    wide = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert "is torch.float64; allowed: torch.float32" in state_problem(wide, torch.optim.AdamW(wide))
    params, optimizer = _trained([(2,)])
    assert state_problem(params, optimizer) == ""

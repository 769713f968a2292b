"""The training state of a list of parameters as one flat fp32 tensor, so a layer moves between
pipeline ranks as one message.

Layout: a header of three numbers per parameter (has a gradient, has optimizer state, Adam's step
count), then all weights, all gradients (zeros where none), all ``exp_avg``, all ``exp_avg_sq``
(zeros where no state), each in parameter order. Both ends list the parameters in
``named_parameters()`` order of a layer built from the same spec, so the order agrees without
sending names. Adam's step is exact in fp32 up to 2**24 steps (it is an fp32 tensor in torch's
AdamW already).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_KEYS = frozenset(("step", *MOMENTS))  # what torch.optim.AdamW (amsgrad off) keeps per parameter
HEADER = 3  # per parameter: has_grad, has_state, step


def state_problem(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> str:
    """Why ``params``' state cannot travel as fp32 (``""`` when it can)."""
    for p in params:
        if p.dtype != torch.float32:
            return f"a parameter of shape {tuple(p.shape)} is {p.dtype}; allowed: torch.float32"
        state = optimizer.state.get(p, {})
        if state and set(state) != STATE_KEYS:
            return f"optimizer state keys {sorted(state)}; allowed: {sorted(STATE_KEYS)} (AdamW, amsgrad off)"
        for key in MOMENTS:
            value = state.get(key)
            if value is not None and (value.dtype != torch.float32 or value.shape != p.shape):
                return f"optimizer state {key} is {value.dtype} {tuple(value.shape)}; allowed: float32 {tuple(p.shape)}"
    return ""


def packed_numel(params: Sequence[torch.nn.Parameter]) -> int:
    return HEADER * len(params) + (2 + len(MOMENTS)) * sum(p.numel() for p in params)


def pack(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Weights, gradients and optimizer state of ``params`` (checked by ``state_problem``)."""
    header: list[float] = []
    states = [optimizer.state.get(p, {}) for p in params]
    for p, state in zip(params, states):
        header += [float(p.grad is not None), float(bool(state)), float(state["step"]) if state else 0.0]
    body = [p.detach().reshape(-1) for p in params]
    body += [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params]
    for key in MOMENTS:
        body += [(s[key] if s else torch.zeros_like(p)).detach().reshape(-1) for p, s in zip(params, states)]
    return torch.cat([torch.tensor(header, dtype=torch.float32), *body])


def unpack(flat: torch.Tensor, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Give ``params`` (and their entries in ``optimizer.state``) the state ``pack`` wrote."""
    if flat.numel() != packed_numel(params):
        raise ValueError(f"packed state has {flat.numel()} numbers; these parameters need {packed_numel(params)}")
    header = flat[: HEADER * len(params)].view(len(params), HEADER).tolist()
    offset = HEADER * len(params)

    def take(p: torch.nn.Parameter) -> torch.Tensor:
        nonlocal offset
        piece = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
        return piece

    with torch.no_grad():
        for p in params:
            p.copy_(take(p))
    for p, (has_grad, _, _) in zip(params, header):
        grad = take(p)
        p.grad = grad if has_grad else None
    moments = {key: [take(p) for p in params] for key in MOMENTS}
    for i, (p, (_, has_state, step)) in enumerate(zip(params, header)):
        optimizer.state.pop(p, None)
        if has_state:
            state = {"step": torch.tensor(step, dtype=torch.float32)}
            optimizer.state[p] = dict(state, **{key: moments[key][i] for key in MOMENTS})

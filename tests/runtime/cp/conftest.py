import functools

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, varlen_attention
from megatron_slim.runtime.spawn import run_ranks
from tests.runtime.cp import _plans, _workers

WORLD = _plans.NODES * _plans.PER_NODE


@pytest.fixture(scope="session")
def engine_results():
    """Per rank: the engine on every test plan (float64 and float32), the disagreement check and
    the remap runs -- one spawn of 4 gloo ranks."""
    return run_ranks(_workers.engine_suite, WORLD, timeout_s=300)


@functools.cache
def reference(lengths: tuple[int, ...], dv: int, dtype_name: str):
    """Single-rank varlen causal attention over the whole pack, in float64: out, dq, dk, dv."""
    q, k, v, dout = _workers.pack_tensors(sum(lengths), dv, getattr(torch, dtype_name), seed=7)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, backend=ReferenceBackend())
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad

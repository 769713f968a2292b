import functools

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.attention import library_reference_grads
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
    return library_reference_grads(q, k, v, dout, lengths)

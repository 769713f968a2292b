"""Slice attention with a K/V cache equals whole-sequence causal attention, values and gradients."""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend, attention
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_attention import sliced_attention
from megatron_slim.runtime.pipeline.slice_context import SliceInfo


def _whole(q, k, v, weight):
    out = attention(q, k, v, causal=True, backend=ReferenceBackend())
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", [ReferenceBackend(), SdpaBackend()], ids=["reference", "sdpa"])
@pytest.mark.parametrize("lengths", [(8, 8, 8, 8), (11, 5, 3, 1), (32,), (1, 1, 30)])
def test_sliced_equals_whole_sequence(backend, lengths):
    torch.manual_seed(sum(lengths) * 7 + len(lengths))
    b, hq, hkv, d, s = 2, 4, 2, 8, sum(lengths)
    q = torch.randn(b, s, hq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, s, hkv, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, s, hkv, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(b, s, hq, d, dtype=torch.float64)
    ref_out, ref_dq, ref_dk, ref_dv = _whole(*(t.detach().clone().requires_grad_() for t in (q, k, v)), weight)

    store = KVCacheStore()
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    pieces, outs = [], []
    for j, (a, n) in enumerate(zip(starts, lengths)):
        qs, ks, vs = (t.detach()[:, a : a + n].clone().requires_grad_() for t in (q, k, v))
        info = SliceInfo(0, j, len(lengths), a, n)
        outs.append(
            sliced_attention(qs, ks, vs, backend=backend, softmax_scale=d**-0.5, store=store, info=info, layer=1)
        )
        pieces.append((qs, ks, vs))
    assert store.live_bytes > 0
    for j in reversed(range(len(lengths))):
        a, n = starts[j], lengths[j]
        (outs[j] * weight[:, a : a + n]).sum().backward()
    assert store.is_empty() and store.live_bytes == 0
    tol = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([o.detach() for o in outs], 1), ref_out, **tol)
    for idx, ref in zip(range(3), (ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(torch.cat([p[idx].grad for p in pieces], 1), ref, **tol)


def test_out_of_order_slices_are_refused():
    store = KVCacheStore()
    q = torch.randn(1, 4, 2, 4)
    with pytest.raises(RuntimeError, match="lacks the prefix"):
        sliced_attention(
            q,
            q[:, :, :1],
            q[:, :, :1],
            backend=ReferenceBackend(),
            softmax_scale=0.5,
            store=store,
            info=SliceInfo(0, 1, 2, 4, 4),
            layer=1,
        )


def test_forward_only_appends_without_graph():
    store = KVCacheStore()
    with torch.no_grad():
        for j in range(3):
            x = torch.randn(1, 4, 2, 4)
            sliced_attention(
                x,
                x,
                x,
                backend=ReferenceBackend(),
                softmax_scale=0.5,
                store=store,
                info=SliceInfo(5, j, 3, 4 * j, 4, forward_only=True),
                layer=2,
            )
    assert store.live_bytes == 3 * 2 * x.numel() * 4
    store.drop_microbatch(5)
    assert store.is_empty() and store.live_bytes == 0


def test_recomputed_slices_read_the_cached_prefix_and_append_nothing():
    """As under activation checkpointing: each slice's forward runs without autograd (it caches
    its K/V), and its backward first runs the forward again (``recompute``) with autograd."""
    torch.manual_seed(3)
    lengths, b, hq, hkv, d = (5, 3, 8), 2, 4, 2, 8
    s = sum(lengths)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for h in (hq, hkv, hkv))
    weight = torch.randn(b, s, hq, d, dtype=torch.float64)
    ref = _whole(*(t.clone().requires_grad_() for t in (q, k, v)), weight)
    store, starts = KVCacheStore(), [0, 5, 8]
    kwargs = dict(backend=ReferenceBackend(), softmax_scale=d**-0.5, store=store, layer=1)
    outs = []
    for j, (a, n) in enumerate(zip(starts, lengths)):
        with torch.no_grad():
            outs.append(
                sliced_attention(
                    q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], **kwargs, info=SliceInfo(0, j, 3, a, n)
                )
            )
    cached = store.live_bytes
    with pytest.raises(RuntimeError, match="slice 0 is recomputed with 3 cached slices"):
        sliced_attention(q[:, :5], k[:, :5], v[:, :5], **kwargs, info=SliceInfo(0, 0, 3, 0, 5, recompute=True))
    grads = []
    for j in reversed(range(3)):
        a, n = starts[j], lengths[j]
        pieces = [t[:, a : a + n].clone().requires_grad_() for t in (q, k, v)]
        out = sliced_attention(*pieces, **kwargs, info=SliceInfo(0, j, 3, a, n, recompute=True))
        assert store.live_bytes == cached  # nothing appended
        torch.testing.assert_close(out.detach(), outs[j])
        (out * weight[:, a : a + n]).sum().backward()
        cached = store.live_bytes
        grads.insert(0, [p.grad for p in pieces])
    assert store.is_empty()
    torch.testing.assert_close(torch.cat(outs, 1), ref[0])
    for idx in range(3):
        torch.testing.assert_close(torch.cat([g[idx] for g in grads], 1), ref[idx + 1])

"""Packed windows: per-document slice geometry, and K/V-cached slice attention over documents that
cross slice boundaries equals whole-window varlen attention (values and gradients, float64)."""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend
from megatron_slim.runtime.pipeline.documents import (
    SliceDocuments,
    check_document_lengths,
    lengths_from_block_mask,
    slice_documents,
    slice_positions,
)
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_attention import sliced_attention
from megatron_slim.runtime.pipeline.slice_context import SliceInfo
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.attention import naive_grads
from tests.runtime.pipeline import _packed_workers
from tests.runtime.pipeline._packed_workers import block_causal_mask

DOCS = (3, 14, 2, 2, 5, 6)


def test_slice_documents_cut_each_document_to_the_slice_and_its_own_earlier_keys():
    assert slice_documents(DOCS, 0, 8) == SliceDocuments(0, (3, 5), (3, 5))
    assert slice_documents(DOCS, 8, 8) == SliceDocuments(3, (8,), (13,))  # middle of a 14-token document
    assert slice_documents(DOCS, 16, 8) == SliceDocuments(3, (1, 2, 2, 3), (14, 2, 2, 3))
    assert slice_documents(DOCS, 24, 8) == SliceDocuments(21, (2, 6), (5, 6))
    assert slice_documents((8, 24), 8, 8) == SliceDocuments(8, (8,), (8,))  # starts on the boundary


def test_slice_positions_restart_in_each_document():
    assert slice_positions(DOCS, 0, 32) == [p for n in DOCS for p in range(n)]
    assert slice_positions(DOCS, 15, 4) == [12, 13, 0, 1]


def test_block_causal_mask_gives_its_documents_and_other_masks_none():
    assert lengths_from_block_mask(block_causal_mask(DOCS)) == DOCS
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1).view(1, 1, 6, 6)
    assert lengths_from_block_mask(causal) == (6,)
    bad = block_causal_mask((2, 4)).clone()
    bad[0, 0, 5, 0] = False  # row 5 also sees the first document
    assert lengths_from_block_mask(bad) is None
    assert lengths_from_block_mask(torch.zeros(2, 1, 4, 4, dtype=torch.bool)) is None  # b = 2


@pytest.mark.parametrize("lengths", [(3, 4), [0, 7], (3.0, 4), (3, 5)])
def test_bad_document_lengths_are_refused_naming_the_key(lengths):
    with pytest.raises(ValueError, match="document_lengths"):
        check_document_lengths(lengths, 7 if lengths != (3, 4) else 8)


@pytest.mark.parametrize("backend", [ReferenceBackend(), SdpaBackend()], ids=["reference", "sdpa"])
@pytest.mark.parametrize("slices", [(8, 8, 8, 8), (5, 11, 7, 9), (32,), (1, 1, 30)])
@pytest.mark.parametrize("docs", [DOCS, (8, 1, 20, 3), (32,)])
def test_sliced_documents_equal_whole_window_varlen(backend, slices, docs):
    torch.manual_seed(len(slices) * 31 + len(docs))
    hq, hkv, d, s = 4, 2, 8, 32
    q, k, v = (torch.randn(s, h, d, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(s, hq, d, dtype=torch.float64)
    ref_out, _, ref_dq, ref_dk, ref_dv = naive_grads(q, k, v, dout, True, d**-0.5, varlen_lens=(docs, docs))
    store, starts, pieces, outs = KVCacheStore(), [sum(slices[:j]) for j in range(len(slices))], [], []
    for j, (a, n) in enumerate(zip(starts, slices)):
        part = [t[a : a + n].unsqueeze(0).clone().requires_grad_() for t in (q, k, v)]
        info = SliceInfo(0, j, len(slices), a, n)
        outs.append(
            sliced_attention(
                *part, backend=backend, softmax_scale=d**-0.5, store=store, info=info, layer=1,
                documents=slice_documents(docs, a, n),
            )
        )  # fmt: skip
        pieces.append(part)
    for j in reversed(range(len(slices))):
        a, n = starts[j], slices[j]
        outs[j].backward(dout[a : a + n].unsqueeze(0))
    assert store.is_empty() and store.live_bytes == 0
    tol = dict(atol=1e-6, rtol=1e-5)  # dK/dV of later slices accumulate in fp32
    torch.testing.assert_close(torch.cat([o.detach()[0] for o in outs]), ref_out, **tol)
    for idx, ref in enumerate((ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(torch.cat([p[idx].grad[0] for p in pieces]), ref, **tol)


CP_CASES = [
    ("reference", (8, 8, 8, 8), DOCS),
    ("sdpa", (8, 16, 8), (8, 1, 20, 3)),
    ("reference", (16, 8, 8), (1, 1, 30)),
    ("sdpa", (32,), DOCS),
    ("reference", (8, 24), (5, 2, 9, 16)),
]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_sliced_documents_equal_whole_window_varlen(cp):
    results = run_ranks(_packed_workers.cp_document_cases, cp, CP_CASES, timeout_s=300)
    for index, (_, slices, docs) in enumerate(CP_CASES):
        q, k, v, dout = _packed_workers.document_qkv(index, sum(slices))
        out, _, dq, dk, dv = naive_grads(q, k, v, dout, True, 8**-0.5, varlen_lens=(docs, docs))
        want = {"out": out, "dq": dq, "dk": dk, "dv": dv}
        got = {name: torch.zeros_like(t) for name, t in want.items()}
        for rank_results in results:
            r = rank_results[index]
            assert r["empty"]
            for name in got:
                got[name][r["rows"]] = r[name]
        for name in got:
            torch.testing.assert_close(
                got[name], want[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{slices} {docs} {name}: {m}"
            )

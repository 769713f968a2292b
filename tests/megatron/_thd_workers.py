"""Rank function for the THD model test (spawned by run_ranks; megatron is imported inside)."""

from __future__ import annotations

import torch

from tests.megatron._workers import tiny_config

REAL = (9, 3, 12, 5)  # real tokens per document
PADDED = (12, 4, 12, 8)  # their slots in the pack (padded offsets)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_seq_params(padded: bool):
    from megatron.core.packed_seq_params import PackedSeqParams

    slots = PADDED if padded else REAL
    cu, cu_padded = _offsets(REAL), _offsets(PADDED) if padded else None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(slots),
        max_seqlen_kv=max(slots),
    )


def _real_rows(padded: bool) -> list[slice]:
    slots, rows, start = PADDED if padded else REAL, [], 0
    for n, slot in zip(REAL, slots):
        rows.append(slice(start, start + n))
        start += slot
    return rows


def thd_model(rank, world_size, seed):
    """A whole model fed one THD pack (unpadded and padded) and, as the reference, each document as
    its own ``[1, n]`` batch: per-token losses of the real tokens and the summed-loss gradients."""
    from megatron_slim.megatron.model.gpt import build_chunk, global_grads
    from megatron_slim.megatron.model.parallel import model_parallel

    cfg = tiny_config()
    g = torch.Generator().manual_seed(seed)
    out = {}
    with model_parallel(seed=seed) as groups:
        chunk = build_chunk(cfg, groups, layers=range(cfg.num_layers), pre_process=True, post_process=True, seed=seed)
        for padded in (False, True):
            total = sum(PADDED if padded else REAL)
            ids, labels = (torch.randint(0, cfg.vocab_size, (1, total), generator=g) for _ in range(2))
            rows = _real_rows(padded)
            losses = chunk(ids, None, None, labels=labels, packed_seq_params=packed_seq_params(padded))
            torch.cat([losses[:, r] for r in rows], dim=1).sum().backward()
            packed = (torch.cat([losses.detach()[:, r] for r in rows], dim=1), global_grads(chunk))
            chunk.zero_grad(set_to_none=True)
            per_doc = [chunk(ids[:, r], None, None, labels=labels[:, r]) for r in rows]
            torch.cat(per_doc, dim=1).sum().backward()
            reference = (torch.cat([t.detach() for t in per_doc], dim=1), global_grads(chunk))
            chunk.zero_grad(set_to_none=True)
            whole = chunk(ids, None, None, labels=labels).detach()  # no documents: the power check
            out[padded] = {"packed": packed, "reference": reference, "whole": torch.cat([whole[:, r] for r in rows], 1)}
    return out

"""The data side of Zeppelin context parallelism: a pack's plans, this rank's batch, the loss.

**Plans.** ``plan_microbatch(lengths, topo, costs, engine=, remap=)`` gives the ``CPPlan``,
``RoutingPlan`` and ``RemapPlan`` of one pack, the same values the CP simulator prices; hand them
to ``CPContext.set_plan`` on every CP rank before the microbatch's forward. Every plan runs, also
one that leaves a CP rank without tokens (that rank runs one masked padding row, ``cp.padding``);
``cp.lengths`` says where a pack's sequence lengths come from.

**Batch.** A microbatch is one pack of ``L`` tokens made of whole sequences (``plan.lengths``).
``cp_batch`` keeps this rank's tokens in the plan's attention-layout order (``RankLayout``) as a
``[1, T]`` batch and adds ``position_ids`` (offsets inside each sequence; ``CPRotary`` reads the
same values from the plan). Every rank of the CP group must get the same pack and the same plan.

**Loss.** The single-process reference's microbatch loss is ``sum over all L tokens of
mask * loss / sum(mask)``; under CP each rank holds only its tokens. ``cp_loss_func`` returns what
megatron-core's ``forward_step`` (3-tuple form, 0.14+) needs for the gradients to equal it:

* default (``calculate_per_token_loss=False``): megatron divides the returned loss by the returned
  ``num_tokens`` and by the microbatch count, and DDP *averages* gradients over data x context
  parallel ranks. So the loss is ``cp * local_sum`` and ``num_tokens`` the CP group's total
  masked-token count (an all-reduce): averaging ``cp * local_sum / total`` over the ``cp`` ranks
  gives ``sum(local_sums) / total``, the reference.
* ``per_token_loss=True`` (``--calculate-per-token-loss``): megatron does not divide; it sums
  ``num_tokens`` over data x context parallel ranks and scales the *summed* gradients by its
  inverse. So the loss is ``local_sum`` and ``num_tokens`` the local count.

``cp_normalised`` applies the same to any loss function's local ``(loss_sum, num_tokens, report)``
(the Megatron-LM hooks wrap ``pretrain_gpt.loss_func`` with it). The report is
``[local_sum, local_count]`` in both cases: megatron sums report pairs over data x
context parallel ranks before dividing, which gives the pack's mean loss.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_slim.megatron.cp.padding import padding_rows
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.engines import plan_pack, uses_remap
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.remap import RemapPlan, plan_remap_for
from megatron_slim.plan.cp.routing import RoutingPlan, plan_routing
from megatron_slim.plan.cp.topology import CPTopology


def plan_microbatch(
    lengths: tuple[int, ...],
    topo: CPTopology,
    costs: CPCosts,
    *,
    engine: str = "zeppelin",
    remap: bool = False,
    routing: bool = True,
    hierarchical: bool = True,
) -> tuple[CPPlan, Optional[RoutingPlan], Optional[RemapPlan]]:
    """The plans of one pack exactly as the CP simulator builds them (``plan.sim.cp_sim``): placement,
    routing (Zeppelin only; K/V bytes per row from ``costs``) and remap (Zeppelin with ``remap``).
    Pure and deterministic: every CP rank computes the same values from the same lengths."""
    plan = plan_pack(
        engine,
        tuple(lengths),
        topo,
        costs,
        remap=uses_remap(engine, remap),
        routing=routing and engine == "zeppelin",
        hierarchical=hierarchical,
    )
    routes = plan_routing(plan, topo, costs.kv_bytes) if routing and engine == "zeppelin" else None
    moves = plan_remap_for(plan, topo) if uses_remap(engine, remap) else None
    return plan, routes, moves


def layout_index(plan: CPPlan, rank: int, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """Pack positions of ``rank``'s tokens in its attention-layout order."""
    return torch.tensor(
        [s.pack_start + i for s in plan.ranks[rank].segments for i in range(s.length)], dtype=torch.long, device=device
    )


def cp_batch(batch: Mapping[str, Any], plan: CPPlan, rank: int) -> dict[str, Any]:
    """``batch``'s per-token tensors (``[L]`` or ``[1, L]``) cut to this rank's ``[1, T]`` tokens, plus
    ``position_ids`` from the plan. ``attention_mask`` is dropped (the engine attends causally within
    each of the plan's sequences); any other per-token tensor is gathered, anything else passed on.
    A rank the plan leaves without tokens gets one padding row with ``loss_mask`` 0 (``cp.padding``)."""
    L = plan.pack_length
    padded = padding_rows(plan, rank)
    if padded and torch.is_tensor(batch.get("labels")) and not torch.is_tensor(batch.get("loss_mask")):
        raise ValueError(
            f"CP rank {rank} holds no token of the pack and runs a padding row, which needs a "
            "loss_mask to keep it out of the loss; allowed: a batch with loss_mask beside labels"
        )
    out: dict[str, Any] = {}
    index = None
    for name, value in batch.items():
        if name in ("attention_mask", "position_ids"):
            continue  # causal per sequence by construction; positions come from the plan
        if not torch.is_tensor(value):
            out[name] = value
            continue
        flat = value.reshape(-1) if value.dim() == 2 and value.shape[0] == 1 else value
        if flat.dim() != 1 or flat.shape[0] != L:
            raise ValueError(
                f"batch[{name!r}] has shape {tuple(value.shape)}; allowed: [{L}] or [1, {L}] "
                f"(one pack of the plan's {L} tokens)"
            )
        if index is None:
            index = (
                layout_index(plan, rank, flat.device)
                if not padded
                else torch.zeros(padded, dtype=torch.long, device=flat.device)
            )
        out[name] = flat[index].unsqueeze(0)
        if padded and name == "loss_mask":
            out[name] = torch.zeros_like(out[name])
    positions = plan.ranks[rank].position_ids() + [0] * padded
    device = index.device if index is not None else None
    out["position_ids"] = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0)
    return out


def cp_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, cp_group, *, per_token_loss: bool = False):
    """megatron-style ``(loss, num_tokens, report)`` of this CP rank (see the module docstring)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    local_sum = torch.sum(losses * mask)
    local_count = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([local_sum.detach().view(1), local_count.float().view(1)])}
    return cp_normalised(local_sum, local_count, report, cp_group, per_token_loss=per_token_loss)


def cp_normalised(
    local_sum: torch.Tensor, local_count: torch.Tensor, report: Any, cp_group, *, per_token_loss: bool = False
):
    """A local ``(loss_sum, num_tokens, report)`` turned into what megatron's normalisation needs
    under CP (module docstring): ``(cp * loss_sum, CP-wide count, report)``; unchanged with
    ``per_token_loss`` (megatron then sums counts over data x context parallel ranks itself)."""
    if per_token_loss:
        return local_sum, local_count, report
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    total = local_count.detach().clone()
    if cp > 1:
        dist.all_reduce(total, group=cp_group)
    return local_sum * cp, total, report

"""Whether the message NCCL would hand a receive is the one it expects, and whether the two ends
posted the messages between them in an order NCCL can run (``p2p.py`` says how both are known)."""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from megatron_slim.plan.schedule.pair_order import crossing
from megatron_slim.runtime.nccl_rules.wire import NcclRuleBroken


def check_match(header: dict, expected: dict, send_site: Callable[[tuple[str, int], int], str]) -> None:
    """Raise :class:`NcclRuleBroken` if the message NCCL would deliver is not the one the receive expects."""
    me, peer, group = dist.get_rank(), expected["peer"], expected["group"]
    theirs, mine = f"rank {peer} posted at {_described(header)}", f"rank {me} posted at {_described(expected)}"
    where = f"communicator {group}, message #{expected['seq']} from rank {peer} to rank {me}"
    if (header.get("numel"), header.get("dtype")) != (expected["numel"], expected["dtype"]):
        raise NcclRuleBroken(
            f"{where}: NCCL matches in posting order and this send and receive differ in size or dtype: "
            f"sent as {theirs}; received as {mine}"
        )
    if header.get("tag") != expected["tag"]:
        raise NcclRuleBroken(
            f"{where}: NCCL ignores tags and would deliver the message {theirs} to the receive {mine}, "
            f"which expects another message"
        )
    (received_lo, received_hi), (sent_lo, sent_hi) = header["received"], expected["sent"]
    crossed = crossing((received_lo, received_hi), (sent_lo, sent_hi))  # the planner's own check of each pair
    if crossed == "sends":  # each side's send waits for the other's receive, queued behind it
        raise NcclRuleBroken(
            f"{where}: NCCL would deadlock once messages outgrow its buffers: rank {me} posted its send #{received_hi} "
            f"to rank {peer} ({send_site((group, peer), received_hi)}) before this receive ({expected['site']}), and "
            f"rank {peer} posted the send it matches ({header.get('site')}) before its receive of that message; post "
            f"both in one batch_isend_irecv, or receive first on one of the two ranks"
        )
    if crossed == "receives":  # each side's receive waits for a send queued behind the other's receive
        raise NcclRuleBroken(
            f"{where}: NCCL would deadlock: rank {peer} posted its receive of rank {me}'s message #{sent_hi} before "
            f"the send this receive matches ({header.get('site')}), while rank {me} posts that message's send after "
            f"this receive ({expected['site']}); the messages between two ranks must be posted in one order on both"
        )


def _described(record: dict) -> str:
    return (
        f"{record.get('site')} (tag {record.get('tag')}, {record.get('numel')} x {record.get('dtype')}, "
        f"shape {record.get('shape')})"
    )

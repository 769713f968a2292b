"""Zeppelin's context-parallel runtime: the attention engine, the routing of its hops and the remap.

Reads the planner's values (``plan.cp``: ``CPPlan``, ``RoutingPlan``, ``RemapPlan``) and nothing
else; the process group is passed in. Pieces, smallest first:

* ``spans`` -- where the plan's tokens sit in a buffer; ``block_attention`` -- the pair rule (which
  query runs see which key runs) as varlen calls, forward partials merged by log-sum-exp, exact
  backward shares.
* ``comm`` + ``exchange`` -- point-to-point messages on CP ranks; a set of hops posted together,
  routed hops relayed in dispatch / NIC / combine legs as the ``RoutingPlan`` says.
* ``ring`` -- zigzag ring steps; ``split_group`` -- local / zigzag / ulysses / hierarchical as
  "all-to-all in the node, ring across nodes"; ``allgather`` -- the Llama-3 style group.
* ``program`` -- a rank's group tasks in queue order, bound from ``plan.cp.program``'s steps (which
  the simulator prices too); ``engine`` -- the interpreter and the
  autograd function; ``agreement`` -- ranks compare the plan's hash before running it.
* ``remap`` -- the remapping layer's all-to-all between attention and token-balanced layouts.
"""

from megatron_slim.runtime.agreement import check_agreement
from megatron_slim.runtime.cp.agreement import fingerprint
from megatron_slim.runtime.cp.comm import Comm
from megatron_slim.runtime.cp.engine import CPAttentionEngine, run_queues
from megatron_slim.runtime.cp.heads import HeadSplit, split_heads
from megatron_slim.runtime.cp.program import RankProgram, compile_rank
from megatron_slim.runtime.cp.remap import move_rows, remap_rows

__all__ = [
    "CPAttentionEngine",
    "Comm",
    "HeadSplit",
    "RankProgram",
    "check_agreement",
    "compile_rank",
    "fingerprint",
    "move_rows",
    "remap_rows",
    "run_queues",
    "split_heads",
]

"""The flags that turn ``megatron-slim simulate`` from one pipeline iteration into another study:
context-parallel engines over variable-length packs (``--cp-engine``/``--lengths``), packing of
variable-length samples (``--packing``) and dynamic models under rebalancing (``--dynamic``).
Kept apart from ``cli.py`` and free of heavy imports: the parser is built on every invocation."""

from __future__ import annotations

import argparse

from megatron_slim.plan.dynmo.schemes import SCHEMES


def add_mode_args(sim: argparse.ArgumentParser) -> None:
    sim.add_argument(
        "--cp-engine",
        metavar="ENGINE",
        help="simulate context-parallel attention over variable-length packs instead of the "
        "pipeline: zeppelin | ring | ulysses | a2a+p2p | allgather | dynamic, 'all', or a "
        "comma list (default with --lengths: the recipe's cp.engine); zeppelin keeps, per pack, "
        "the cheapest of its own placements and the other engines' (the picks are printed); a "
        "recipe's cp.engine=megatron (Megatron-LM's own CP) places no packs and is refused (ring "
        "is its placement of packed documents)",
    )
    sim.add_argument(
        "--lengths",
        metavar="FILE|SPEC",
        help="sequence lengths for --cp-engine or --packing: a file (one length per line) or a spec such as "
        "lognormal:mean=8192,sigma=1.1,min=1024,max=65536 (see plan/cp/lengths.py)",
    )
    sim.add_argument(
        "--seed", type=int, help="seed for drawing --lengths, or of --dynamic moe's router drift (default 0)"
    )
    sim.add_argument(
        "--packing",
        metavar="METHODS",
        help="time packers of variable-length samples with the pipeline simulator instead: 'all' or a "
        "comma list of slimpack, megatron, bfd, lpfhp, hybrid_cp, wlb (docs/packing.md); one global batch "
        "of --lengths filling train.global_batch_size * model.seq_length tokens, split over parallel.dp ranks; "
        "with parallel.cp > 1 slimpack sends each outlier over DP (DP-merge) or over the replica's CP group "
        "(Zeppelin), whichever is cheaper, and reports the count by route",
    )
    sim.add_argument(
        "--micropack-tokens",
        type=int,
        metavar="N",
        help="with --packing: the most tokens one MicroPack (microbatch) holds, the same for every "
        "method (default: model.seq_length)",
    )
    sim.add_argument(
        "--dynamic",
        metavar="SCHEME",
        choices=SCHEMES,
        help="simulate training a dynamic model phase by phase instead: " + " | ".join(SCHEMES) + " (docs/dynmo.md)",
    )
    sim.add_argument(
        "--rebalance",
        metavar="POLICIES",
        help="with --dynamic: comma list of static, dynmo, diffusion (default all; static is the reference)",
    )
    sim.add_argument("--phases", type=int, help="with --dynamic: training phases (default 8)")

"""``megatron-slim recipes``: what ships in megatron_slim/configs/ (or ``$MEGATRON_SLIM_CONFIGS``)."""

from __future__ import annotations

from megatron_slim.plan.hardware import available_profiles, load_hardware
from megatron_slim.plan.paths import config_dir
from megatron_slim.plan.recipe import available_recipes, load_recipe


def main(args) -> int:
    if getattr(args, "names", False):
        print("\n".join(available_recipes()))
        return 0
    print("recipes:")
    if not available_recipes():
        print(f"  (none found in {config_dir()})")
    for name in available_recipes():
        r = load_recipe(name)
        p = r.parallel
        print(
            f"  {name:<20} {r.model.name:<14} seq {r.model.seq_length:>7}  {r.schedule.kind:<11} "
            f"tp{p.tp} pp{p.pp} vpp{p.vpp} cp{p.cp} dp{p.dp} on {r.hardware}  {r.description}"
        )
    print("hardware profiles:")
    if not available_profiles():
        print(f"  (none found in {config_dir() / 'hardware'})")
    for name in available_profiles():
        hw = load_hardware(name)
        print(
            f"  {name:<6} {hw.peak_bf16_flops / 1e12:7.1f} TFLOP/s bf16, {hw.hbm_bytes / 2**30:.0f} GiB, "
            f"{hw.gpus_per_node} GPUs and {hw.nics_per_node} NICs per node"
        )
    return 0

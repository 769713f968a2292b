"""``megatron-slim megatron-args``: the Megatron-LM flags (or node count) a recipe stands for."""

from __future__ import annotations

import shlex
import sys

from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.recipe_note import world_size_note
from megatron_slim.plan.schema import ConfigError


def nodes_for(recipe) -> int:
    world, per_node = recipe.parallel.world_size, recipe.hardware_profile.gpus_per_node
    if world % per_node and world > per_node:
        raise ConfigError(
            f"parallel: tp*pp*cp*dp={world} GPUs do not fill whole nodes of {per_node} "
            f"GPUs (hardware {recipe.hardware}); allowed: a multiple of {per_node}"
        )
    return max(1, world // per_node)


def flag_lines(flags: list[str]) -> list[str]:
    """One line per flag with its values, shell-quoted: ``--num-layers 32``, ``--swiglu``."""
    groups: list[list[str]] = []
    for word in flags:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return [shlex.join(g) for g in groups]


def main(args) -> int:
    recipe = load_recipe(args.recipe, args.set)
    note = world_size_note(args.recipe, args.set, recipe)
    if note:  # stderr: stdout is read by scripts ($(megatron-slim megatron-args ...))
        print(note, file=sys.stderr)
    if args.nodes:
        print(nodes_for(recipe))
    elif args.gpus_per_node:
        print(min(recipe.parallel.world_size, recipe.hardware_profile.gpus_per_node))
    else:
        flags = recipe_to_megatron_args(recipe)
        print(shlex.join(flags) if args.format == "shell" else "\n".join(flag_lines(flags)))
    return 0

import random

import pytest

from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.recipe import load_recipe

RECIPE = "zeppelin-7b-h800"
TOPOLOGIES = {"1x4": (1, 4), "2x2": (2, 2), "4x8": (4, 8), "3x4": (3, 4)}


@pytest.fixture(scope="session")
def recipe():
    return load_recipe(RECIPE)


@pytest.fixture(scope="session")
def costs(recipe):
    return CPCosts.from_recipe(recipe)


def topology(name: str) -> CPTopology:
    nodes, per_node = TOPOLOGIES[name]
    return CPTopology.uniform(nodes, per_node)


def random_pack(rng: random.Random, kind: str, total: int) -> tuple[int, ...]:
    """A pack of ``total`` tokens: mixed, odd, all-tiny or one huge sequence."""
    if kind == "huge":
        return (total,)
    out, left = [], total
    while left:
        if kind == "tiny":
            s = rng.randint(1, 40)
        elif kind == "odd":
            s = 2 * rng.randint(0, 3000) + 1
        else:
            s = int(rng.lognormvariate(7.5, 1.3)) + 1
        s = min(s, left)
        out.append(s)
        left -= s
    return tuple(out)


PACK_KINDS = ("mixed", "odd", "tiny", "huge")


def packs(seed: int, count: int, total: int = 40_000):
    rng = random.Random(seed)
    return [random_pack(rng, PACK_KINDS[i % len(PACK_KINDS)], total) for i in range(count)]

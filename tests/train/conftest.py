import os

import pytest

from tests.conftest import session_dir

SMALL_DATA = ["data.max_files=60"]
# a CPU hardware profile with one GPU per node: 2 CP ranks are 2 nodes (tests/train/test_train_cp*.py)
HARDWARE = """name: cpu-2-nodes
peak_bf16_flops: 1.9e11
hbm_bytes: 25769803776
hbm_bandwidth: 2.0e10
gpus_per_node: 1
nics_per_node: 1
nvlink_bandwidth: 2.0e10
nvlink_latency: 1.0e-6
nic_bandwidth: 5.0e9
nic_latency: 2.0e-6
layer_impl: local
"""


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One corpus cache for the session, all pytest-xdist workers included (preparing a corpus, its
    tokenizer above all, is the slow part of a first run)."""
    path = os.environ.get("MEGATRON_SLIM_TEST_CACHE") or str(session_dir(tmp_path_factory, "corpus-cache"))
    return path


def cut_documents(root, seed: int, sizes, count: int) -> str:
    """Write ``count`` documents into ``root``, cut one after another from two stdlib modules at
    lengths drawn (seeded) from ``sizes`` characters; returns the folder."""
    import random

    from megatron_slim.data import stdlib_root

    text = "".join((stdlib_root() / name).read_text() for name in ("argparse.py", "textwrap.py"))
    rng, pos = random.Random(seed), 0
    for i in range(count):
        size = rng.choice(sizes)
        (root / f"doc{i:04d}.txt").write_text(text[pos : pos + size])
        pos += size
    return str(root)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A corpus of short documents cut from stdlib modules, so a window packs several."""
    return cut_documents(tmp_path_factory.mktemp("short-docs"), 0, [60, 120, 250, 500, 900, 1600], 200)


@pytest.fixture(scope="module")
def hardware(tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "cpu-2-nodes.yaml"
    path.write_text(HARDWARE)
    return str(path)

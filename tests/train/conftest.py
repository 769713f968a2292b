import os

import pytest

SMALL_DATA = ["data.max_files=60"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One corpus cache for the session (preparing it is the slow part of a first run)."""
    path = os.environ.get("MEGATRON_SLIM_TEST_CACHE") or str(tmp_path_factory.mktemp("corpus-cache"))
    return path

import pytest
import yaml

FAST_LINKS = {
    "name": "fast-links",
    "peak_bf16_flops": 989.4e12,
    "hbm_bytes": 85899345920,
    "hbm_bandwidth": 3.35e12,
    "gpus_per_node": 8,
    "nics_per_node": 8,
    "nvlink_bandwidth": 1e18,
    "nvlink_latency": 0.0,
    "nic_bandwidth": 1e18,
    "nic_latency": 0.0,
}


@pytest.fixture
def fast_links_profile(tmp_path):
    """An H100-like profile whose links cost nothing: isolates the schedule's own bubble."""
    path = tmp_path / "fast-links.yaml"
    path.write_text(yaml.safe_dump(FAST_LINKS))
    return str(path)

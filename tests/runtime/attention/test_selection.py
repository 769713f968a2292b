"""select_backend: order, forcing by argument or environment, errors, logging once."""

import logging

import pytest
import torch

from megatron_slim.runtime.attention import ENV_VAR, choose_backend, select_backend, selection


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(selection, "_logged_messages", set())


def test_cpu_default_is_sdpa_and_says_why_faster_backends_were_skipped():
    choice = choose_backend(device="cpu", dtype=torch.float32)
    assert choice.name == "sdpa" and choice.backend.name == "sdpa"
    assert "flash-attn" in choice.reason and "transformer-engine" in choice.reason
    assert choice.describe().startswith("attention backend: sdpa (")


def test_reference_is_the_fallback_where_sdpa_cannot_run():
    choice = choose_backend(device="meta")
    assert choice.name == "reference"
    assert "sdpa: device type 'meta'" in choice.reason


def test_explicit_choice_of_an_unavailable_backend_lists_the_available_ones():
    expected = r"'flash' \(requested\) is unavailable on cpu.*available: \['sdpa', 'reference'\]"
    with pytest.raises(ValueError, match=expected):
        select_backend("flash", device="cpu")
    with pytest.raises(ValueError, match=r"'te' \(requested\) is unavailable"):
        select_backend("te", device="cpu")


def test_unknown_name_lists_the_known_ones():
    expected = r"'magic' \(requested\) is unknown: choose one of \('flash', 'te', 'sdpa', 'reference'\)"
    with pytest.raises(ValueError, match=expected):
        select_backend("magic", device="cpu")


def test_environment_variable_forces_the_backend_and_the_argument_beats_it(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    choice = choose_backend(device="cpu")
    assert choice.name == "reference" and f"forced by {ENV_VAR}" in choice.reason
    assert select_backend("sdpa", device="cpu").name == "sdpa"
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(ValueError, match=f"'nope' \\(forced by {ENV_VAR}\\) is unknown"):
        select_backend(device="cpu")


def test_choice_is_logged_once_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_slim"):
        for _ in range(3):
            select_backend(device="cpu", dtype=torch.bfloat16)
    records = [r for r in caplog.records if r.name == "megatron_slim"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert records[0].getMessage().startswith("attention backend: sdpa (flash-attn")

"""Print what the contract tier measured (relative differences per case) after the run."""

import pytest

MEASURED: list[str] = []


@pytest.fixture
def report_measurement():
    return MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("real Megatron-LM contract: max relative difference vs Megatron's own schedule")
        for line in MEASURED:
            terminalreporter.write_line(line)

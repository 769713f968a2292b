"""Argument types and checks shared by the ``megatron-slim`` subcommands' parsers."""

from __future__ import annotations

import argparse

from megatron_slim.plan.schema import ConfigError


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a finite number of seconds >= 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; allowed: an integer >= 1")
    return value


def refuse_repeated_overrides(parser: argparse.ArgumentParser, overrides: list[str]) -> None:
    """A key given twice in ``--set`` is an error (which one was meant?), not "the last wins"."""
    from megatron_slim.plan.schema import parse_override

    seen: dict[str, str] = {}
    for text in overrides:
        try:
            path, value = parse_override(text)
        except ConfigError:
            continue  # load_recipe names the malformed override
        key = ".".join(path)
        if key in seen:
            parser.exit(
                2, f"megatron-slim: error: --set {key}: given twice ({seen[key]!r} and {value!r}); allowed: once\n"
            )
        seen[key] = value

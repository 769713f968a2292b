"""What every command prints: aligned text tables and JSON to a file or to stdout."""
from __future__ import annotations

import json
import sys
from typing import Sequence, TextIO


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths)),
                      *(fmt.format(*map(str, r)) for r in rows)])


def emit_json(payload: dict, target: str | None, indent: int = 2) -> TextIO:
    """Write ``payload`` to ``target`` (a path, or ``-`` for stdout) and return the stream human
    output should use: stderr when stdout carries the JSON."""
    if target:
        text = json.dumps(payload, indent=indent)
        if target == "-":
            print(text)
        else:
            with open(target, "w") as f:
                f.write(text + "\n")
    return sys.stderr if target == "-" else sys.stdout

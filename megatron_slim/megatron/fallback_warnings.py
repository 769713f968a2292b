"""megatron-core's "Transformer Engine / apex not installed" warnings, said once instead of per rank.

Without Transformer Engine and apex (CPU ranks, most laptops), megatron-core warns from each module
that falls back to torch (optimizer, gradient clipping, fused tensor ops, norms) when it is
imported: about 16 lines per rank, 64 before ``megatron-slim train``'s first iteration on 4 ranks.
``train`` filters exactly those warnings in its own process and its ranks, and prints one line
naming the backends it uses instead (:func:`backends_line`). Other warnings pass as before.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import warnings
from typing import Iterator

# How megatron-core 0.14-0.19's fallback warnings begin (each is a UserWarning).
FALLBACK_MESSAGES = ("Transformer Engine and Apex are not installed", "Apex is not installed")


def quiet_in_this_process() -> None:
    for message in FALLBACK_MESSAGES:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)


@contextlib.contextmanager
def quiet_in_children() -> Iterator[None]:
    """Spawned ranks start with these filters (``PYTHONWARNINGS``, read at interpreter start-up);
    the variable is restored afterwards."""
    before = os.environ.get("PYTHONWARNINGS")
    ours = ",".join(f"ignore:{m}:UserWarning" for m in FALLBACK_MESSAGES)
    os.environ["PYTHONWARNINGS"] = f"{before},{ours}" if before else ours
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = before


def backends_line(attention: str) -> str:
    """One line: the attention backend chosen (``attention``: its label) and what megatron-core uses."""
    missing = [
        name
        for name, module in (("Transformer Engine", "transformer_engine"), ("apex", "apex"))
        if importlib.util.find_spec(module) is None
    ]
    core = (
        f"megatron-core without {' or '.join(missing)}: torch's optimizer, gradient clipping and norms"
        if missing
        else "megatron-core with Transformer Engine and apex"
    )
    return f"backends: attention {attention}; {core}"

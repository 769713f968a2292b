"""Print a short key for what an environment installs: pyproject.toml's dependency lists and pins.

    python scripts/ci/dependency_key.py pyproject.toml EXTRA... [-- PIN...]

The key hashes ``[project].dependencies``, the named optional-dependency lists and the pins after
``--`` (the Makefile's torch and megatron-core versions), so the Makefile names the Python 3.12
environment after its dependencies: an edit elsewhere in pyproject.toml (tool settings, markers)
keeps the environment, a changed dependency makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tomllib
from pathlib import Path


def dependency_key(pyproject: Path, extras: list[str], pins: list[str]) -> str:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        allowed = sorted(optional)
        raise SystemExit(f"dependency_key: no optional-dependencies {unknown} in {pyproject}; allowed: {allowed}")
    what = {"dependencies": project.get("dependencies", []), **{e: optional[e] for e in extras}, "pins": pins}
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    cut = argv.index("--") if "--" in argv else len(argv)
    head, pins = argv[:cut], argv[cut + 1 :]
    print(dependency_key(Path(head[0]), head[1:], pins))


if __name__ == "__main__":
    main(sys.argv[1:])

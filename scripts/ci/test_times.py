"""Tables of test times from pytest's JUnit XML (``pytest --junitxml=F``), for docs/testing.md.

    python scripts/ci/test_times.py after.xml                 # the 25 slowest tests, and totals
    python scripts/ci/test_times.py after.xml --before before.xml [--top 25] [--moved slow.xml]

With ``--before``: the 25 slowest tests of the before run beside their time after, or, for a test
the after run no longer runs, "not in this run", or its time in ``--moved`` (another tier's run,
e.g. ``make test-slow``'s) as "slow tier: N s".
A test's time is what JUnit records for it: setup (its fixtures, module-scoped ones included when
it is the first to use them), call and teardown.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def read_times(path: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    for case in ET.parse(path).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        module = case.get("classname", "").replace(".", "/")
        times[f"{module}.py::{case.get('name')}"] = float(case.get("time", 0.0))
    return times


def table(after: dict[str, float], before: dict[str, float] | None, top: int, moved: dict[str, float]) -> str:
    rows = []
    if before is None:
        rows.append("| test | s |")
        rows.append("|---|---:|")
        for name, seconds in sorted(after.items(), key=lambda kv: -kv[1])[:top]:
            rows.append(f"| `{name}` | {seconds:.1f} |")
    else:
        rows.append("| test | before s | after s |")
        rows.append("|---|---:|---:|")
        for name, seconds in sorted(before.items(), key=lambda kv: -kv[1])[:top]:
            if name in after:
                now = f"{after[name]:.1f}"
            elif name in moved:
                now = f"slow tier: {moved[name]:.1f}"
            else:
                now = "not in this run"
            rows.append(f"| `{name}` | {seconds:.1f} | {now} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("after", type=Path)
    parser.add_argument("--before", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--moved", type=Path, help="another tier's JUnit XML, for tests moved there")
    args = parser.parse_args()
    after = read_times(args.after)
    before = read_times(args.before) if args.before else None
    print(table(after, before, args.top, read_times(args.moved) if args.moved else {}))
    for label, times in (("before", before), ("after", after)):
        if times is not None:
            print(f"\n{label}: {len(times)} tests, {sum(times.values()):.0f} s of test time")


if __name__ == "__main__":
    main()

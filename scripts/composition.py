"""Write docs/composition.md from the start-up rules: python scripts/composition.py [--check]."""

import sys
from pathlib import Path

from megatron_slim.plan.startup.composition import markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "composition.md"

if __name__ == "__main__":
    text = markdown()
    if "--check" in sys.argv[1:]:
        sys.exit(0 if DOC.read_text() == text else f"{DOC}: out of date; run python scripts/composition.py")
    DOC.write_text(text)
    print(f"wrote {DOC}")

"""Rewrite the transition table in docs/transitions.md from `batchstate.TRANSITIONS`.

    python tools/render_transitions.py

tests/docs/test_docs.py fails while the two disagree; this is how to make them agree.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from batchstate.table import render_transitions

DOC: Final = Path(__file__).resolve().parent.parent / "docs" / "transitions.md"
BLOCK: Final = re.compile(r"(<!-- transitions:begin -->\n).*?(<!-- transitions:end -->)", re.S)


def main() -> None:
    """Replace the block between the markers with the rendered table."""
    text = DOC.read_text()
    DOC.write_text(BLOCK.sub(lambda match: match[1] + render_transitions() + match[2], text))
    print(f"rewrote the transition table in {DOC}")


if __name__ == "__main__":
    main()

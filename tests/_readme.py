"""The README's code blocks, so tests can run them as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_block(language: str, containing: str) -> str:
    """The one ``language`` code block of the README that contains ``containing``."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", readme, flags=re.DOTALL)
    (block,) = [b for b in blocks if containing in b]
    return str(block)

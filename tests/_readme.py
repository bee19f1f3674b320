"""The code blocks of the README and of the pages in docs/, so tests can run them as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_block(language: str, containing: str, path: str = "README.md") -> str:
    """The one ``language`` code block of ``path`` (the README unless given) with ``containing``.

    ``path`` is relative to the repository's root, e.g. ``"docs/serving.md"``.
    """
    text = (ROOT / path).read_text()
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)
    matching = [b for b in blocks if containing in b]
    if len(matching) != 1:
        raise LookupError(
            f"{path}: {len(matching)} ```{language} blocks contain {containing!r}, not one"
        )
    return str(matching[0])

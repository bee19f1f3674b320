"""Server-sent events as SGLang's servers write them: ``data: <json>`` and a blank line."""

from __future__ import annotations

from ._json import dumps

__all__ = ["sse_data", "sse_event"]


def sse_event(data: object) -> bytes:
    return sse_data(dumps(data))


def sse_data(json_text: str) -> bytes:
    """One SSE event of already encoded JSON."""
    return b"data: " + json_text.encode() + b"\n\n"

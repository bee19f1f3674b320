"""Turn the engine's native outputs into what the caller asked for, with public ids only."""

from __future__ import annotations

from typing import Any

from ._request import OutputMode

__all__ = ["format_chunk"]


def format_chunk(output: OutputMode, out: dict[str, Any], public_id: str) -> dict[str, Any]:
    """One caller chunk from one engine output; never mutates ``out``.

    ``tokens`` chunks carry no id at all, ``text`` chunks carry the public id,
    and ``native`` outputs are copied with ``meta_info.id`` replaced, so the
    internal rid never reaches the caller.
    """
    meta = out.get("meta_info", {})
    if output == "native":
        return {**out, "meta_info": {**meta, "id": public_id}}
    index = out.get("index", 0)
    finish_reason = _finish_reason(meta.get("finish_reason"))
    if output == "tokens":
        return {
            "index": index,
            "token_ids": list(out.get("output_ids", ())),
            "finish_reason": finish_reason,
        }
    return {
        "id": public_id,
        "object": "text_completion",
        "choices": [{"index": index, "text": out.get("text", ""), "finish_reason": finish_reason}],
    }


def _finish_reason(reason: object) -> str | None:
    """SGLang's ``{"type": "length", ...}`` as OpenAI's ``"length"``."""
    if reason is None:
        return None
    if isinstance(reason, dict):
        return str(reason.get("type", "unknown"))
    return str(reason)

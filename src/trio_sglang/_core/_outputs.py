"""Turn the engine's native outputs into what the caller asked for, with public ids only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._request._parse import OutputMode, ParsedRequest

__all__ = ["PublicIds", "finish_reason_type", "format_chunk"]


@dataclass(frozen=True, slots=True)
class PublicIds:
    """The ids a caller may see: one for the request, and one per child.

    Children (batch prompts, parallel samples) are named by SGLang's output
    ``index``, which is stable per child: the caller's rid list entry when it
    gave one (``<entry>_<j>`` for sample ``j`` of ``n``), else
    ``<request id>_<index>``. The engine's own child ids (``rid_i``, uuids)
    never appear.
    """

    request: str
    children: tuple[str, ...] = ()

    @classmethod
    def for_request(cls, parsed: ParsedRequest, context_id: str) -> PublicIds:
        request = parsed.caller_rid if isinstance(parsed.caller_rid, str) else context_id
        if parsed.single_sample:
            return cls(request)
        n = parsed.n
        if isinstance(parsed.caller_rid, tuple):
            bases = parsed.caller_rid
            children = tuple(base if n == 1 else f"{base}_{j}" for base in bases for j in range(n))
        else:
            children = tuple(f"{request}_{k}" for k in range(parsed.children))
        return cls(request, children)

    def child(self, index: object) -> str:
        if not self.children or not isinstance(index, int):
            return self.request
        if 0 <= index < len(self.children):
            return self.children[index]
        return f"{self.request}_{index}"


def format_chunk(output: OutputMode, out: dict[str, Any], ids: PublicIds) -> dict[str, Any]:
    """One caller chunk from one engine output; never mutates ``out``.

    ``tokens`` chunks carry the child's ``index`` and no id, ``text`` chunks
    carry the request's public id and one OpenAI-style choice per child, and
    ``native`` outputs are copied with ``meta_info.id`` set to the child's
    public id, so no engine-made id reaches the caller. The engine's own
    messages in ``meta_info`` (an abort's reason names its ``req.rid``) get
    the same replacement; the generated ``text`` is the model's, untouched.
    """
    meta = out.get("meta_info", {})
    index = out.get("index", 0)
    if output == "native":
        public = ids.child(out.get("index"))
        engine_id = meta.get("id")
        if not isinstance(engine_id, str) or not engine_id:
            return {**out, "meta_info": {**meta, "id": public}}
        # Counts and flags hold no id: only text and containers are looked into.
        scrubbed = {
            key: value if type(value) in _NO_TEXT else _replace_id(value, engine_id, public)
            for key, value in meta.items()
        }
        scrubbed["id"] = public
        return {**out, "meta_info": scrubbed}
    finish_reason = finish_reason_type(meta.get("finish_reason"))
    if output == "tokens":
        return {
            "index": index,
            "token_ids": list(out.get("output_ids", ())),
            "finish_reason": finish_reason,
        }
    return {
        "id": ids.request,
        "object": "text_completion",
        "choices": [{"index": index, "text": out.get("text", ""), "finish_reason": finish_reason}],
    }


#: The types of ``meta_info`` values that cannot hold an id (the hot path skips them).
_NO_TEXT = frozenset({int, float, bool, type(None)})


def _replace_id(value: object, engine_id: str, public: str) -> Any:
    """``value`` with ``engine_id`` replaced by ``public`` in every string, at any depth."""
    if isinstance(value, str):
        return value.replace(engine_id, public) if engine_id in value else value
    if isinstance(value, dict):
        return {key: _replace_id(item, engine_id, public) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_id(item, engine_id, public) for item in value]
    return value


def finish_reason_type(reason: object) -> str | None:
    """SGLang's ``{"type": "length", ...}`` as OpenAI's ``"length"``: the one reading of it."""
    if reason is None:
        return None
    if isinstance(reason, dict):
        return str(reason.get("type", "unknown"))
    return str(reason)

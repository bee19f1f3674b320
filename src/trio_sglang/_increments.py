"""``IncrementQueue``: one request's outputs waiting for their reader, a child's backlog as one.

SGLang streams incremental outputs: each one's ``text``, ``output_ids`` and
per-token ``meta_info`` lists (logprobs) are deltas, the rest of
``meta_info`` is the newest state. When its reader falls behind, SGLang's
TokenizerManager hands over the whole backlog of a request as one output,
deltas concatenated and the rest from the newest (``_coalesce_streaming_chunks``,
SGLang 0.5.23). This queue does the same as outputs arrive, so that what it
holds grows by a few bytes per token, never by an output dict, and one pull
takes a whole backlog: the SimEngine's streams hold their outputs here, and
so does the server for a client that is slow to take its bytes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["INCREMENTAL_META_KEYS", "IncrementQueue"]

#: The per-token lists in an incremental output's ``meta_info`` (SGLang 0.5.23's
#: ``_INCREMENTAL_STREAMING_META_INFO_KEYS``).
INCREMENTAL_META_KEYS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "output_token_ids_logprobs",
    "output_token_sampling_mask",
    "output_token_sampling_logprobs",
)


class IncrementQueue:
    """Outputs in arrival order; one child's outputs that wait together are merged."""

    def __init__(self) -> None:
        self._entries: deque[_Held] = deque()
        #: Per child (SGLang's output ``index``), its entry still waiting, if any.
        self._waiting: dict[object, _Held] = {}
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens held (an output without token ids counts as one)."""
        return self._tokens

    def put(self, out: dict[str, Any]) -> None:
        tokens = len(out.get("output_ids", ())) or 1
        self._tokens += tokens
        child = out.get("index", 0)
        held = self._waiting.get(child)
        if held is None:
            self._waiting[child] = held = _Held(out, tokens)
            self._entries.append(held)
        else:
            held.append(out, tokens)

    def popleft(self) -> dict[str, Any]:
        held = self._entries.popleft()
        if self._waiting.get(held.out.get("index", 0)) is held:
            del self._waiting[held.out.get("index", 0)]
        self._tokens -= held.tokens
        return held.merged()

    def take_all(self) -> list[dict[str, Any]]:
        outs = [held.merged() for held in self._entries]
        self.clear()
        return outs

    def clear(self) -> None:
        self._entries.clear()
        self._waiting.clear()
        self._tokens = 0


class _Held:
    """One waiting output; merged into, it becomes a copy of its own (the engine's is kept).

    Its text deltas wait in a list, joined once when it is taken: added to a
    string each, a backlog of n tokens would cost n squared, and a reader
    that falls far behind would fall further behind for it.
    """

    __slots__ = ("out", "owned", "texts", "tokens")

    def __init__(self, out: dict[str, Any], tokens: int) -> None:
        self.out = out
        self.owned = False
        self.tokens = tokens
        self.texts: list[str] | None = None

    def merged(self) -> dict[str, Any]:
        """The output, all that was merged into it included."""
        if self.texts is not None:
            self.out["text"] = "".join(self.texts)
            self.texts = None
        return self.out

    def append(self, out: dict[str, Any], tokens: int) -> None:
        if not self.owned:
            self._own()
        mine = self.out
        text, ids = mine.get("text", ""), mine.get("output_ids")
        meta: dict[str, Any] = mine.get("meta_info", {})
        mine.update(out)  # the newest state; then the deltas, added up in lists of our own
        if "text" in out:
            if self.texts is None:
                self.texts = [text]
            self.texts.append(out["text"])
        if "output_ids" in out:
            if ids is None:
                ids = []
            ids.extend(out["output_ids"])
            mine["output_ids"] = ids
        newest = out.get("meta_info")
        if newest is not None:
            merged = dict(newest)
            for key in INCREMENTAL_META_KEYS:
                old, new = meta.get(key), newest.get(key)
                if isinstance(new, list):
                    if isinstance(old, list):
                        old.extend(new)
                        merged[key] = old
                    else:
                        merged[key] = list(new)
                elif key not in newest and isinstance(old, list):
                    merged[key] = old
            mine["meta_info"] = merged
        self.tokens += tokens

    def _own(self) -> None:
        out = dict(self.out)
        if "output_ids" in out:
            out["output_ids"] = list(out["output_ids"])
        meta = out.get("meta_info")
        if meta is not None:
            out["meta_info"] = {
                key: list(value)
                if key in INCREMENTAL_META_KEYS and isinstance(value, list)
                else value
                for key, value in meta.items()
            }
        self.out = out
        self.owned = True

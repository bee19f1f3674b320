"""``POST /generate``: SGLang's native body in, SGLang's native outputs back."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from .._errors import InvalidRequest
from .._request._fields import SGLANG_FIELDS
from .._request._values import shown
from ._plan import Plan
from ._sse import sse_event

__all__ = ["NativePlan"]

logger = logging.getLogger("trio_sglang.server")


class NativePlan(Plan):
    """Streams SGLang's (incremental) output dicts; otherwise answers the totals.

    The public id is the caller's ``rid`` (``<rid>_<i>`` or the list entry
    for children), else a fresh ``gen-...`` id: the worker's own engine rid
    never appears. The body is validated by the worker itself, but for its
    fields that SGLang's ``GenerateReqInput`` does not have: they are ignored,
    as SGLang's ``/generate`` ignores them (FastAPI reads the body into that
    dataclass, and its contract check, ``api_contract.generate_contract_error``,
    ignores unknown keys too), and logged at DEBUG. Unknown sampling
    parameters are refused there, and so here (by the worker).
    """

    def __init__(self, native: dict[str, Any], stream: bool) -> None:
        rid = native.get("rid")
        # The request's id: what /abort_request names it by (a rid list names children).
        public_id = rid if isinstance(rid, str) and rid else f"gen-{uuid.uuid4().hex}"
        super().__init__(native, public_id, stream)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> NativePlan:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequest("'stream' must be a bool", param="stream")
        # sglang-router adds "model" (null) to every /generate body: ignored, as by SGLang.
        ignored = sorted(key for key in body if key not in SGLANG_FIELDS)
        if ignored:
            # shown(): a client's keys, bounded.
            logger.debug("ignored fields SGLang's /generate does not have: %s", shown(ignored))
        native = {k: v for k, v in body.items() if k in SGLANG_FIELDS and k != "stream"}
        return cls(native, stream)

    def sse(self, index: int, out: dict[str, Any]) -> bytes:
        return sse_event(out)

    def body(self) -> object:
        many = not self.parsed.single_sample  # a list, as SGLang answers batches and n > 1
        results = [
            {
                "text": child.text,
                "output_ids": child.output_ids,
                "meta_info": child.meta,
                **({"index": index} if many else {}),
            }
            for index, child in sorted(self.children.items())
        ]
        return results if many else results[0]

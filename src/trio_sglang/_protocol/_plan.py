"""What every endpoint shares: the request for the worker, and what came back per child."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core._outputs import PublicIds, finish_reason_type
from .._core._worker import PreparedRequest, Worker
from .._request._parse import ParsedRequest

__all__ = ["ChildResult", "Plan"]

#: The finish reason SGLang gives a request that ``/abort_request`` stopped while
#: it ran (``FINISH_ABORT().to_json()``, SGLang 0.5.23). It has no status code, so
#: SGLang ends the response as for any finish, with no error (its
#: ``_handle_abort_finish_reason``, and the OpenAI servers after it).
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class ChildResult:
    """One child's output so far: its newest state; for a body, also its text and ids in all.

    SGLang streams increments; a streamed response sends each as it comes.
    """

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Plan(ABC):
    """One request as an endpoint understands it.

    ``native`` is the SGLang body for ``worker.generate(..., output="native")``;
    ``add`` sees every output, streaming or not; subclasses turn outputs into
    SSE events (``sse``, ``closing_events``) or a single body (``body``).
    """

    #: The native field (top-level, or ``sampling_params.<name>``) -> the client's name for it.
    names: Mapping[str, str] = {}

    def __init__(self, native: dict[str, Any], public_id: str, stream: bool) -> None:
        self.native = native
        self.public_id = public_id
        self.stream = stream
        self.children: dict[int, ChildResult] = {}
        self._prepared: PreparedRequest | None = None

    def prepare(self, worker: Worker) -> PreparedRequest:
        """The native body, checked once by ``worker`` in the client's words; for ``generate``.

        The plan then answers by what the worker parsed: how many children, and their ids.
        """
        self._prepared = worker.prepare(self.native, "native", names=self.names)
        return self._prepared

    @property
    def parsed(self) -> ParsedRequest:
        """The request as the worker runs it (``prepare`` first)."""
        if self._prepared is None:
            raise RuntimeError("the plan's request was not prepared")
        return self._prepared.parsed

    def add(self, out: dict[str, Any]) -> tuple[int, ChildResult]:
        """Take one output into its child's result: the newest state, and for a body, the totals.

        A streamed response sends its text and token ids as they come and never
        needs them again: only a body (``stream`` false) adds them up.
        """
        index = out.get("index", 0)
        child = self.children.get(index)
        if child is None:
            child = self.children[index] = ChildResult()
        if not self.stream:
            child.text += out.get("text", "")
            child.output_ids.extend(out.get("output_ids", ()))
        meta = out.get("meta_info", {})
        child.meta = meta
        reason = finish_reason_type(meta.get("finish_reason"))
        if reason is not None:
            child.finish_reason = reason
        return index, child

    def aborted_outputs(self, request_id: str) -> list[dict[str, Any]]:
        """The last output of each child ``/abort_request`` stopped, as SGLang's.

        Every child not finished yet, seen or not, ends with no new tokens and
        the finish reason ``ABORTED``, under its public id (``request_id`` is
        the request's, its ``RequestContext``'s); its counts are its last ones.
        """
        parsed = self.parsed
        ids = PublicIds.for_request(parsed, request_id)
        outs = []
        for index in range(parsed.children):
            child = self.children.get(index)
            if child is not None and child.finish_reason is not None:
                continue
            meta = {"completion_tokens": 0} if child is None else child.meta
            out: dict[str, Any] = {
                "text": "",
                "output_ids": [],
                "meta_info": {**meta, "id": ids.child(index), "finish_reason": dict(ABORTED)},
            }
            if not parsed.single_sample:
                out["index"] = index
            outs.append(out)
        return outs

    @abstractmethod
    def sse(self, index: int, out: dict[str, Any]) -> bytes:
        """The SSE event (or events) of one output, already added."""

    def closing_events(self) -> list[dict[str, Any]]:
        """SSE payloads after the last output, before ``[DONE]``."""
        return []

    @abstractmethod
    def body(self) -> object:
        """The whole response, for a request that did not ask to stream."""

"""What every endpoint shares: the request for the worker, and what came back per child."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import InvalidRequest
from .._fields import check_honoured, unsupported
from .._outputs import PublicIds
from .._request import parse_request
from ._errors import HTTPError

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
    #: Usage reports the prompt's cached tokens (``--enable-cache-report``); the server sets it.
    cache_report = False

    def __init__(self, native: dict[str, Any], public_id: str, stream: bool, n: int) -> None:
        self.native = native
        self.public_id = public_id
        self.stream = stream
        self.n = n
        self.children: dict[int, ChildResult] = {}

    def check(self, features: Mapping[str, object]) -> None:
        """What the worker would refuse, refused in the client's words; after admission.

        Here: a field the engine does not honour. The worker refuses it too, but
        in the native body's words (``sampling_params.min_new_tokens`` where the
        client sent ``min_tokens``).
        """
        try:
            check_honoured(self.native, features)
        except InvalidRequest as exc:
            name = self.names.get(exc.param or "", exc.param or "")
            raise HTTPError(400, unsupported(name, features), param=name) from None

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
        reason = meta.get("finish_reason")
        if reason is not None:
            child.finish_reason = (
                str(reason.get("type")) if isinstance(reason, dict) else str(reason)
            )
        return index, child

    def aborted_outputs(self, request_id: str) -> list[dict[str, Any]]:
        """The last output of each child ``/abort_request`` stopped, as SGLang's.

        Every child not finished yet, seen or not, ends with no new tokens and
        the finish reason ``ABORTED``, under its public id (``request_id`` is
        the request's, its ``RequestContext``'s); its counts are its last ones.
        """
        parsed = parse_request(self.native, "native")  # as the worker parsed it, without fail
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

    def usage(self) -> dict[str, Any]:
        """OpenAI usage: each prompt counted once (its cached tokens too), every child's completion.

        As SGLang's ``UsageProcessor``: a prompt's counts are its first child's.
        """
        prompts: dict[int, dict[str, Any]] = {}
        completion = 0
        for index, child in sorted(self.children.items()):
            prompts.setdefault(index // self.n, child.meta)
            completion += int(child.meta.get("completion_tokens", 0))
        prompt = sum(int(meta.get("prompt_tokens", 0)) for meta in prompts.values())
        cached = sum(int(meta.get("cached_tokens", 0)) for meta in prompts.values())
        return self._usage(prompt, completion, cached)

    def child_usage(self, index: int) -> dict[str, Any]:
        """One child's usage so far: its prompt and its completion.

        Read from the newest output's ``meta_info``, which counts every token
        so far, also when one event carries several (a client behind, ``Outbox``).
        """
        meta = self.children[index].meta
        return self._usage(
            int(meta.get("prompt_tokens", 0)),
            int(meta.get("completion_tokens", 0)),
            int(meta.get("cached_tokens", 0)),
        )

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.cache_report:
            # SGLang's --enable-cache-report: the prompt tokens its prefix cache held.
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    @abstractmethod
    def sse(self, index: int, out: dict[str, Any]) -> bytes:
        """The SSE event (or events) of one output, already added."""

    def closing_events(self) -> list[dict[str, Any]]:
        """SSE payloads after the last output, before ``[DONE]``."""
        return []

    @abstractmethod
    def body(self) -> object:
        """The whole response, for a request that did not ask to stream."""

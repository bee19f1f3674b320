"""What every endpoint shares: the request for the worker, and what came back per child."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChildResult", "Plan"]


@dataclass
class ChildResult:
    """One child's output so far (SGLang streams increments; these are totals)."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Plan(ABC):
    """One request as an endpoint understands it.

    ``native`` is the SGLang body for ``worker.generate(..., output="native")``;
    ``add`` sees every output, streaming or not; subclasses turn outputs into
    SSE events (``events``, ``closing_events``) or a single body (``body``).
    """

    def __init__(self, native: dict[str, Any], public_id: str, stream: bool, n: int) -> None:
        self.native = native
        self.public_id = public_id
        self.stream = stream
        self.n = n
        self.children: dict[int, ChildResult] = {}

    def add(self, out: dict[str, Any]) -> tuple[int, ChildResult]:
        index = out.get("index", 0)
        child = self.children.setdefault(index, ChildResult())
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

    def usage(self) -> dict[str, int]:
        """OpenAI usage: each prompt counted once, every child's completion."""
        prompt_tokens: dict[int, int] = {}
        completion = 0
        for index, child in self.children.items():
            prompt_tokens[index // self.n] = int(child.meta.get("prompt_tokens", 0))
            completion += int(child.meta.get("completion_tokens", 0))
        prompt = sum(prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    @abstractmethod
    def events(self, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        """SSE payloads for one output (already added)."""

    def closing_events(self) -> list[dict[str, Any]]:
        """SSE payloads after the last output, before ``[DONE]``."""
        return []

    @abstractmethod
    def body(self) -> object:
        """The whole response, for a request that did not ask to stream."""

"""One client's visit: its request, the moment its phase says to leave, and what it saw.

Each visit has its own client and so its own connection, as separate users
have (``_clients`` makes it, reads the events and leaves). Leaving right
after sending cancels the read once the request's last byte is written;
before the first token, at a deadline after sending; at the first token or
mid-stream, between two events. Every visit is bounded by the request
timeout: a server's bad answer fails that visit, never the run.

Tokens are counted from the events: exactly on ``/generate`` (its
``meta_info.completion_tokens``), one per event with text on the OpenAI
routes (a server that merges tokens into one event, as it may for a client
that is behind, makes this a lower bound).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import trio

from .._bounded_http import BadAnswer, parse_json, read_answer
from ._apis import API_PATHS, Api, request_body
from ._clients import Stream, http_client, leave_when_sent, read_events
from ._departures import Phase

__all__ = ["LeaveRule", "Target", "Visit", "discover_model", "visit"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where the requests go and what they ask for."""

    url: str
    api: Api
    model: str | None
    headers: dict[str, str]
    max_tokens: int
    prompt_words: int
    ignore_eos: bool
    timeout: float

    def body(self, index: int, max_tokens: int | None = None) -> dict[str, Any]:
        """A streaming request in the API's dialect; the index opens the prompt, so that no
        two requests share a cached prefix."""
        prompt = f"Request {index}: " + " ".join(["hello"] * self.prompt_words)
        tokens = self.max_tokens if max_tokens is None else max_tokens
        path = API_PATHS[self.api]
        return request_body(path, prompt, tokens, model=self.model, ignore_eos=self.ignore_eos)

    def client(self, *, reset: bool = False) -> httpx.AsyncClient:
        return http_client(self.url, self.timeout, headers=self.headers, reset=reset)


@dataclass(frozen=True, slots=True)
class LeaveRule:
    #: ``before_first_token``: seconds after sending.
    delay: float
    #: ``mid_stream``: token events read before leaving.
    chunks: int


@dataclass(slots=True)
class Visit:
    """What one client did and saw, on the trio clock."""

    phase: str
    sent_at: float = math.nan
    #: When it left (connection closed), or read ``[DONE]``, or gave up.
    ended_at: float = math.nan
    outcome: Literal["left", "completed", "failed"] = "failed"
    error: str | None = None
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    def itl(self) -> list[float]:
        times = self.token_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]


async def visit(
    target: Target,
    phase: Phase,
    rule: LeaveRule,
    record: Visit,
    index: int,
    max_tokens: int | None = None,
) -> None:
    """One request, to its end or to its phase's moment of leaving; never raises for the server's
    faults (they end up in ``record``)."""
    body = target.body(index, max_tokens)
    async with target.client(reset=phase.reset) as client:
        with trio.move_on_after(target.timeout) as guard:
            record.sent_at = trio.current_time()
            leave = trio.CancelScope()
            if phase.leave == "before_first_token":
                leave.deadline = record.sent_at + rule.delay
            sent = leave_when_sent(leave) if phase.leave == "before_headers" else None
            try:
                with leave:
                    await _read(client, target, body, phase, rule, record, sent)
            except BadAnswer as exc:  # the call failed, or its answer broke a bound
                record.outcome, record.error = "failed", str(exc)[:300]
            except (ValueError, TypeError, AttributeError) as exc:  # an answer not as its API's
                record.outcome, record.error = "failed", f"unreadable answer: {exc!r:.200}"
            if leave.cancelled_caught:
                record.outcome = "left"
        if guard.cancelled_caught:
            record.outcome, record.error = "failed", f"no end within {target.timeout:g} s"
        if record.outcome != "completed":
            record.ended_at = trio.current_time()  # its connection is closed by now


async def _read(
    client: httpx.AsyncClient,
    target: Target,
    body: dict[str, Any],
    phase: Phase,
    rule: LeaveRule,
    record: Visit,
    sent: dict[str, Any] | None,
) -> None:
    stream = Stream()

    def on_event(data: str) -> bool:
        """Count the event's tokens; True to leave (this phase's moment, or an error event)."""
        event = parse_json(data)
        if event is None and data != "null":
            raise ValueError(f"an event that is not JSON (or nested too deep): {data[:100]!r}")
        if isinstance(event, dict) and "error" in event:
            record.error = f"error event: {str(event['error'])[:200]}"
            return True
        new = _new_tokens(target.api, event, record.tokens)
        if not new:
            return False
        record.tokens += new
        record.token_times.append(trio.current_time())
        if _leaves_now(phase, rule, record):
            record.outcome = "left"
            return True
        return False

    await read_events(client, API_PATHS[target.api], body, stream, on_event, extensions=sent)
    if stream.status != 200:
        record.error = f"HTTP {stream.status}: {stream.head}"
    elif record.error is None and record.outcome != "left":
        record.outcome, record.ended_at = "completed", stream.ended_at


def _leaves_now(phase: Phase, rule: LeaveRule, record: Visit) -> bool:
    """After a token event: whether the client goes now (a token that comes before the
    ``before_first_token`` delay is the moment too: that client is counted as early)."""
    if phase.leave in ("first_token", "before_first_token", "before_headers"):
        return True
    return phase.leave == "mid_stream" and len(record.token_times) >= rule.chunks


def _new_tokens(api: Api, event: Any, seen: int) -> int:
    if not isinstance(event, dict):
        return 0
    if api == "sglang-generate":
        meta = event.get("meta_info")
        completion = meta.get("completion_tokens") if isinstance(meta, dict) else None
        if isinstance(completion, int):
            return max(0, completion - seen)
        return 1 if event.get("text") else 0
    choices = event.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    if api == "openai-completions":
        return 1 if choice.get("text") else 0
    delta = choice.get("delta") or {}
    return 1 if delta.get("content") or delta.get("reasoning_content") else 0


async def discover_model(target: Target) -> str:
    """The first model ``/v1/models`` lists, which SGLang, vLLM, Dynamo and serve all answer."""
    async with target.client() as client:
        try:
            answer = await read_answer(
                client, "GET", "/v1/models", max_bytes=1 << 20, within=target.timeout
            )
        except BadAnswer as exc:
            raise LookupError(str(exc)) from exc
    if not answer.ok:
        raise LookupError(f"{target.url}/v1/models answered HTTP {answer.status}")
    listing = answer.json()
    models = listing.get("data") if isinstance(listing, dict) else None
    first = models[0] if isinstance(models, list) and models else None
    if not isinstance(first, dict) or "id" not in first:
        raise LookupError(f"{target.url}/v1/models lists no model: name one with --model")
    return str(first["id"])

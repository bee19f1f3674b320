"""The load: simulated users streaming from the server, each one leaving now and then.

Every user is a trio task with its own ``httpx.AsyncClient`` (separate users have
separate connections); why httpx, and how a user leaves: docs/benchmarks.md, "Load over
loopback". The client, its request and its reading are bench-endpoint's
(``trio_sglang.bench_endpoint._clients``, one leaving client for both); this module keeps
what is the load test's: when a user leaves, what counts as a token (every data event),
what it times and how a request ended. Every wait is bounded: each request by
``trio.move_on_after`` (its moment of leaving, or ``request_timeout``), the whole run by
a ``trio.fail_after`` guard that only a bug can reach.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import trio

from trio_sglang.bench_endpoint._apis import request_body
from trio_sglang.bench_endpoint._clients import BadAnswer, Stream, http_client, read_events

__all__ = [
    "ENDPOINTS",
    "LEFT",
    "LoadShape",
    "Outcome",
    "Tally",
    "http_client",
    "run_clients",
]

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")

#: How a request ended. A client that leaves "before the first token" may be
#: early enough that no response (not even its headers) came back yet.
Outcome = Literal[
    "completed", "left_before_headers", "left_before_first_token", "left_mid_stream", "failed"
]
LEFT: tuple[Outcome, ...] = ("left_before_headers", "left_before_first_token", "left_mid_stream")

_ERROR_EVENT = '{"error"'


@dataclass(frozen=True, slots=True)
class LoadShape:
    """What the users do; times in seconds."""

    clients: int
    duration: float
    #: The share of requests abandoned; half of those before the first token.
    disconnect_fraction: float
    max_tokens: int
    #: When the first token is due after a request is sent, and then every token.
    first_token_after: float
    token_interval: float
    #: Users start at uniformly random moments within this first part of the
    #: duration, so that their tokens are not all due in the same instant.
    ramp: float
    #: A request not done after this long counts as failed (a bound, not a target).
    request_timeout: float
    seed: int

    @property
    def deadline(self) -> float:
        """The most a run can take: its last request starts just before the end."""
        return self.duration + self.request_timeout + 5.0

    def leave_after(self, rng: random.Random) -> float | None:
        """When to abandon the next request (seconds after sending it), or None to read it all."""
        if rng.random() >= self.disconnect_fraction:
            return None
        if rng.random() < 0.5:
            return rng.uniform(0.0, self.first_token_after)
        last_token = self.first_token_after + (self.max_tokens - 1) * self.token_interval
        return rng.uniform(self.first_token_after, last_token)


@dataclass(slots=True)
class Tally:
    """What the users saw. Every request ends in exactly one outcome."""

    outcomes: Counter[tuple[str, Outcome]] = field(default_factory=Counter)
    #: Why failed requests failed: an httpx error's class, a status, a timeout...
    failures: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    #: Error events inside a 200 stream (the server ending it: each a server error), by
    #: their OpenAI ``code`` (``shutting_down``, ``engine_error``, or ``null``).
    stream_errors: Counter[str] = field(default_factory=Counter)
    #: Server-sent events with a token (one token each: ``n`` is 1, unless the
    #: server coalesced a backlog into one event for a client behind).
    tokens: int = 0
    in_flight: int = 0
    #: Seconds from sending a request to its first token event (TTFT), and
    #: between two token events of one response (ITL), as the users saw them.
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def count(self, outcome: Outcome | None = None, endpoint: str | None = None) -> int:
        """Requests that ended so, at that endpoint (None: any)."""
        return sum(
            value
            for (where, what), value in self.outcomes.items()
            if outcome in (None, what) and endpoint in (None, where)
        )

    def server_errors(self) -> int:
        """5xx answers, as a status or as an error event in the stream."""
        statuses = sum(count for status, count in self.statuses.items() if status >= 500)
        return statuses + sum(self.stream_errors.values())


@dataclass(slots=True)
class _Seen(Stream):
    """One request as the reader filled it in (its status, ``[DONE]``), and as the user saw it."""

    tokens: int = 0
    error: str | None = None
    #: When the request was sent, and when its last token event came.
    sent_at: float = 0.0
    last_at: float | None = None

    def token(self, tally: Tally) -> None:
        """A token event now: its TTFT or its ITL goes into the tally."""
        now = trio.current_time()
        if self.last_at is None:
            tally.ttft.append(now - self.sent_at)
        else:
            tally.itl.append(now - self.last_at)
        self.last_at = now
        self.tokens += 1


async def _read(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], seen: _Seen, tally: Tally
) -> None:
    def on_event(data: str) -> bool:
        """A token event (every data event but an error), timed; an error event, read on."""
        if data.startswith(_ERROR_EVENT):
            seen.error = str(json.loads(data)["error"]["code"])
        else:
            seen.token(tally)
        return False  # the user leaves only at its moment: the caller's deadline

    seen.sent_at = trio.current_time()
    await read_events(client, endpoint, body, seen, on_event, reuse=True)


async def _request(
    client: httpx.AsyncClient,
    endpoint: str,
    body: dict[str, Any],
    leave_after: float | None,
    shape: LoadShape,
    tally: Tally,
) -> None:
    seen = _Seen()
    outcome: Outcome = "failed"
    tally.in_flight += 1
    try:
        with trio.move_on_after(
            shape.request_timeout if leave_after is None else leave_after
        ) as scope:
            await _read(client, endpoint, body, seen, tally)
    except BadAnswer as exc:  # named by the httpx error under it: ReadError, ReadTimeout...
        tally.failures[type(exc.__cause__ or exc).__name__] += 1
    else:
        outcome = _outcome(seen, leave_after, scope.cancelled_caught, tally)
    finally:
        tally.in_flight -= 1
    tally.tokens += seen.tokens
    if seen.status is not None:
        tally.statuses[seen.status] += 1
    tally.outcomes[endpoint, outcome] += 1


def _outcome(seen: _Seen, leave_after: float | None, cut: bool, tally: Tally) -> Outcome:
    """Judge one request that raised nothing; count why it failed, if it did."""
    if seen.error is not None:
        tally.stream_errors[seen.error] += 1
        tally.failures[f"error event {seen.error}"] += 1
        return "failed"
    if seen.status not in (None, 200):
        tally.failures[f"HTTP {seen.status}"] += 1
        return "failed"
    if seen.done:
        return "completed"  # including one that ended before its moment to leave
    if seen.status is None:
        phase: Outcome = "left_before_headers"
    else:
        phase = "left_mid_stream" if seen.tokens else "left_before_first_token"
    if cut and leave_after is not None:
        return phase
    where = phase.removeprefix("left_").replace("_", " ")
    tally.failures[f"timed out {where}" if cut else "stream ended without [DONE]"] += 1
    return "failed"


async def _client(
    index: int, url: str, model: str, shape: LoadShape, stop_at: float, tally: Tally
) -> None:
    """One user: requests one after another; after leaving one, a new ``AsyncClient``.

    A user who left has closed the connection anyway, and the new client steps around
    encode/httpcore#1093 (still in 1.0.9): a request cancelled while its new connection
    was being established leaves a pool slot taken, and the next request waits for it.
    """
    rng = random.Random(f"{shape.seed}/{index}")
    await trio.sleep(rng.uniform(0.0, shape.ramp))
    while trio.current_time() < stop_at:
        async with http_client(url, shape.request_timeout) as client:
            leave_after: float | None = None
            while leave_after is None and trio.current_time() < stop_at:
                endpoint = rng.choice(ENDPOINTS)
                prompt = f"user {index} says hello"
                body = request_body(endpoint, prompt, shape.max_tokens, model=model)
                leave_after = shape.leave_after(rng)
                await _request(client, endpoint, body, leave_after, shape, tally)


async def run_clients(url: str, model: str, shape: LoadShape, tally: Tally) -> None:
    """Run ``shape.clients`` users for ``shape.duration`` s; return once every request ended.

    The duration includes the ramp; no request starts after it, and the last
    ones are read to their end (or left at their moment) as usual.
    """
    stop_at = trio.current_time() + shape.duration
    with trio.fail_after(shape.deadline):
        async with trio.open_nursery() as nursery:
            for index in range(shape.clients):
                nursery.start_soon(_client, index, url, model, shape, stop_at, tally)

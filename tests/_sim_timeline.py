"""The SimEngine's default timeline, and a harness that runs it on MockClock, for its tests.

Seconds after the first pull (``make_engine()``): registered at 0, tokenized
until 1, dispatched at 1.5, tokens at 2.5, 3.0, 3.5 ... (one every 0.5 s); a
three-token request finishes at 3.5.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from trio_sglang import EngineStream, SimEngine

TOKENIZE = 1.0
DISPATCH = 0.5
FIRST_TOKEN = 1.0
INTERVAL = 0.5
DISPATCHED_AT = TOKENIZE + DISPATCH  # 1.5
FIRST_TOKEN_AT = DISPATCHED_AT + FIRST_TOKEN  # 2.5
LATER = 20.0  # long after anything could still happen
UUID_HEX = re.compile(r"[0-9a-f]{32}")
ABORTS = ("abort_requested", "abort_dropped", "abort_applied", "abort_lost")
KNOBS = ("tokenize_delay", "dispatch_delay", "first_token_delay", "token_interval")

Timeline = list[tuple[float, str]]


def make_engine(**timing: float) -> SimEngine:
    """The default timeline, with some knobs overridden."""
    assert set(timing) <= set(KNOBS), timing
    return SimEngine(
        tokenize_delay=timing.get("tokenize_delay", TOKENIZE),
        dispatch_delay=timing.get("dispatch_delay", DISPATCH),
        first_token_delay=timing.get("first_token_delay", FIRST_TOKEN),
        token_interval=timing.get("token_interval", INTERVAL),
    )


def request(
    rid: str | list[str], text: str | list[str] = "hello world", **sampling: int
) -> dict[str, Any]:
    """An SGLang ``/generate`` body; three new tokens unless told otherwise."""
    sampling.setdefault("max_new_tokens", 3)
    return {"text": text, "rid": rid, "sampling_params": sampling}


def normal_run(max_new_tokens: int = 3, dispatched_at: float = DISPATCHED_AT) -> Timeline:
    """A request that nothing stops: every token, then ``finished``."""
    first = dispatched_at + FIRST_TOKEN
    tokens = [(first + i * INTERVAL, "token") for i in range(max_new_tokens)]
    return [
        (0.0, "registered"),
        (dispatched_at, "dispatched"),
        *tokens,
        (tokens[-1][0], "finished"),
    ]


def finish_reason(out: dict[str, Any]) -> Any:
    return out["meta_info"]["finish_reason"]


def registered_rids(engine: SimEngine) -> list[str]:
    """Every rid the engine registered, in order."""
    return [event.rid for event in engine.trace if event.kind == "registered"]


@dataclass
class Pulled:
    """What one consumer got: outputs with their arrival times, and how it ended."""

    outputs: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ended_at: float | None = None  # when StopAsyncIteration came


@dataclass
class Harness:
    """A running engine, a nursery for consumers, and the clock relative to the start."""

    engine: SimEngine
    nursery: trio.Nursery
    t0: float

    def now(self) -> float:
        return trio.current_time() - self.t0

    async def at(self, offset: float) -> None:
        await trio.sleep_until(self.t0 + offset)

    def timeline(self, rid: str) -> Timeline:
        return [(event.time - self.t0, event.kind) for event in self.engine.trace.of(rid)]

    async def pull(self, stream: EngineStream, pulled: Pulled, limit: float = math.inf) -> None:
        """Pull up to ``limit`` outputs (to the end by default), leaving the stream open."""
        while len(pulled.outputs) < limit:
            try:
                out = await stream.__anext__()
            except StopAsyncIteration:
                pulled.ended_at = self.now()
                return
            pulled.outputs.append(out)
            pulled.times.append(self.now())

    def consume(self, stream: EngineStream, limit: float = math.inf) -> Pulled:
        """Start pulling ``stream`` in a sibling task; returns what it records."""
        pulled = Pulled()
        self.nursery.start_soon(self.pull, stream, pulled, limit)
        return pulled


@asynccontextmanager
async def started(engine: SimEngine) -> AsyncIterator[Harness]:
    async with engine.running(), trio.open_nursery() as nursery:
        yield Harness(engine, nursery, trio.current_time())


def assert_idle(engine: SimEngine) -> None:
    assert engine.live_rids() == set()
    assert engine.tokenizer_manager.rid_to_state == {}
    assert engine.tokenizer_manager.scheduler.rids() == set()

"""An engine wrapper that misbehaves on purpose, for the lifecycle's fallback paths."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import trio

import trio_sglang as ts

AbortMode = Literal["ok", "raise", "refuse", "raise_once"]


class BreakingStream:
    """Passes outputs through, then raises as if the engine crashed mid-stream."""

    def __init__(self, inner: ts.EngineStream, outputs_before_error: int) -> None:
        self.inner = inner
        self.left = outputs_before_error

    def __aiter__(self) -> BreakingStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.left == 0:
            raise RuntimeError("engine crashed mid-stream")
        self.left -= 1
        return await self.inner.__anext__()

    async def aclose(self) -> None:
        await self.inner.aclose()


class FaultyEngine:
    """Delegates to a ``SimEngine``; ``abort`` raises, does nothing, or works.

    With ``break_after``, every stream raises after that many outputs; the
    features named in ``lacks`` are reported as missing.
    ``on_close`` is called as the engine starts to close, so tests can check
    what the worker had finished by then.
    """

    def __init__(
        self,
        sim: ts.SimEngine,
        abort_mode: AbortMode = "ok",
        on_close: Callable[[], None] | None = None,
        break_after: int | None = None,
        lacks: frozenset[str] = frozenset(),
    ) -> None:
        self.sim = sim
        self.lacks = lacks
        self.abort_mode = abort_mode
        self.on_close = on_close
        self.break_after = break_after
        self.abort_calls: list[float] = []
        self.closed_at: float | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.sim.running():
            try:
                yield
            finally:
                self.closed_at = trio.current_time()
                if self.on_close is not None:
                    self.on_close()

    def features(self) -> Mapping[str, object]:
        return {**self.sim.features(), **dict.fromkeys(self.lacks, False)}

    def generate(self, request: Mapping[str, Any]) -> ts.EngineStream:
        stream = self.sim.generate(request)
        if self.break_after is None:
            return stream
        return BreakingStream(stream, self.break_after)

    def phase(self, rid: str) -> ts.RequestPhase:
        return self.sim.phase(rid)

    async def wait_phase_change(self, rid: str, phase: ts.RequestPhase) -> ts.RequestPhase:
        return await self.sim.wait_phase_change(rid, phase)

    def live_requests(self) -> int:
        return self.sim.live_requests()

    def abort(self, rid: str) -> None:
        self.abort_calls.append(trio.current_time())
        if self.abort_mode == "raise" or (
            self.abort_mode == "raise_once" and len(self.abort_calls) == 1
        ):
            raise ConnectionError("scheduler socket unavailable")
        if self.abort_mode != "refuse":
            self.sim.abort(rid)

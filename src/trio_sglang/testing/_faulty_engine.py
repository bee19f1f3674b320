"""``FaultyEngine``: any engine, with faults injected into the requests you pick.

Faults act where a real engine fails, so the lifecycle meets them through the
same protocol calls: ``abort`` raises, hangs or returns without effect;
``phase`` never shows the dispatch; a pull raises, blocks for ever, or never
reaches the engine; ``aclose`` raises or hangs. Everything not faulted is
passed to the wrapped engine untouched, so its own semantics (SGLang's
release on close, lost aborts before dispatch) still hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import trio

from .._engine import ChatTemplating, Engine, EngineFeatures, EngineStream, RequestPhase
from .._protocol._transcript import plain_transcript
from .._request._values import check_at_least

__all__ = ["AbortFault", "CloseFault", "Faults", "FaultyEngine"]

FEATURE_FIELDS = dataclasses.fields(EngineFeatures)

#: ``raise``: the call raises ``ConnectionError``; ``hang``: it never returns;
#: ``ignore``: it returns and nothing happens.
AbortFault = Literal["ok", "raise", "hang", "ignore"]
#: ``raise``: closing raises before the engine is told; ``hang``: it never returns.
CloseFault = Literal["ok", "raise", "hang"]


@dataclass(frozen=True, slots=True)
class Faults:
    """What goes wrong with each request the faults apply to."""

    abort: AbortFault = "ok"
    #: How many abort calls per rid misbehave before aborts work (None: all).
    abort_failures: int | None = None
    #: The stream raises ``RuntimeError`` once it has yielded this many outputs.
    stream_error_after: int | None = None
    #: The stream blocks for ever once it has yielded this many outputs; the
    #: engine goes on running the request.
    stream_silent_after: int | None = None
    #: The engine never hears of the request: its first pull blocks for ever.
    never_register: bool = False
    #: ``phase`` never reports ``DISPATCHED`` (the dispatch mark is missing).
    hide_dispatch: bool = False
    close: CloseFault = "ok"

    def __post_init__(self) -> None:
        for name in ("abort_failures", "stream_error_after", "stream_silent_after"):
            value = getattr(self, name)
            if value is not None:  # None: no such fault
                check_at_least(f"Faults.{name}", value, 0, integer=True)


class FaultyEngine:
    """Wraps ``engine``; requests for which ``select(request)`` is true get ``faults``.

    ``select`` sees the ``/generate`` body the worker sends (its ``text``,
    ``sampling_params``, ...); by default every request is faulty. Children
    of a faulty ``n > 1`` request are faulty too, from their first output.
    ``features`` overrides fields of what the wrapped engine reports (e.g.
    ``{"release_on_close": False}`` to drive the worker's fallback paths).

    Introspection: ``aborts`` (clock time and rid of every abort call),
    ``faulty_rids`` and ``closed_at`` (when ``running()`` was left).
    """

    def __init__(
        self,
        engine: Engine,
        faults: Faults | None = None,
        *,
        select: Callable[[Mapping[str, Any]], bool] | None = None,
        features: Mapping[str, Any] | None = None,
    ) -> None:
        self.inner = engine
        self.faults = Faults() if faults is None else faults
        self._select = select
        self._features = dict(features or {})
        unknown = self._features.keys() - {field.name for field in FEATURE_FIELDS}
        if unknown:
            raise TypeError(f"not fields of EngineFeatures: {', '.join(sorted(unknown))}")
        self._faulty: set[str] = set()
        self._abort_calls: dict[str, int] = {}
        self._in_flight: set[trio.CancelScope] = set()
        self._gone = False
        self.aborts: list[tuple[float, str]] = []
        self.closed_at: float | None = None

    @property
    def faulty_rids(self) -> frozenset[str]:
        """The engine rids the faults apply to (children included, once seen)."""
        return frozenset(self._faulty)

    # -- faults on demand -------------------------------------------------------

    def close_abruptly(self) -> None:
        """The engine goes away with requests in flight (a crashed scheduler).

        Every pull in progress and every later one raises ``ConnectionResetError``.
        """
        self._gone = True
        for scope in self._in_flight:
            scope.cancel()

    # -- the Engine protocol ------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.inner.running():
            try:
                yield
            finally:
                self.closed_at = trio.current_time()

    def features(self) -> EngineFeatures:
        return dataclasses.replace(self.inner.features(), **self._features)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False
    ) -> str | list[int]:
        """The wrapped engine's chat template (faults are for requests, not prompts).

        An engine without one gets the plain transcript, as the server gives it.
        """
        if isinstance(self.inner, ChatTemplating):
            return self.inner.render_chat(messages, continue_final_message=continue_final_message)
        return plain_transcript(messages, continue_final_message=continue_final_message)

    def generate(self, request: Mapping[str, Any]) -> EngineStream:
        stream = self.inner.generate(request)
        if self._select is not None and not self._select(request):
            return _FaultyStream(self, stream, Faults(), faulty=False)
        rids = request.get("rid")
        self._faulty.update([rids] if isinstance(rids, str) else rids or ())
        return _FaultyStream(self, stream, self.faults, faulty=True)

    def phase(self, rid: str) -> RequestPhase:
        phase = self.inner.phase(rid)
        if phase is RequestPhase.DISPATCHED and self._faulted(rid).hide_dispatch:
            return RequestPhase.REGISTERED
        return phase

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        while (current := self.phase(rid)) is phase:
            await self.inner.wait_phase_change(rid, self.inner.phase(rid))
        return current

    async def abort(self, rid: str) -> None:
        self.aborts.append((trio.current_time(), rid))
        faults = self._faulted(rid)
        calls = self._abort_calls[rid] = self._abort_calls.get(rid, 0) + 1
        if faults.abort == "ok" or (
            faults.abort_failures is not None and calls > faults.abort_failures
        ):
            await self.inner.abort(rid)
        elif faults.abort == "raise":
            raise ConnectionError(f"injected: the scheduler socket refused the abort of {rid}")
        elif faults.abort == "hang":
            await trio.sleep_forever()
        else:
            await trio.lowlevel.checkpoint()  # "ignore": returns, and nothing happens

    def live_requests(self) -> int:
        return self.inner.live_requests()

    # -- for the streams ------------------------------------------------------------

    def _faulted(self, rid: str) -> Faults:
        return self.faults if rid in self._faulty else _NO_FAULTS

    def _note_child(self, out: Mapping[str, Any]) -> None:
        rid = (out.get("meta_info") or {}).get("id")
        if isinstance(rid, str):
            self._faulty.add(rid)


_NO_FAULTS = Faults()


class _FaultyStream:
    def __init__(
        self, engine: FaultyEngine, inner: EngineStream, faults: Faults, *, faulty: bool
    ) -> None:
        self._engine = engine
        self._inner = inner
        self._faults = faults
        self._faulty = faulty
        self._outputs = 0

    def __aiter__(self) -> _FaultyStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        faults = self._faults
        if self._engine._gone:
            raise ConnectionResetError("injected: the engine went away")
        if faults.never_register or self._outputs == faults.stream_silent_after:
            await trio.sleep_forever()
        if self._outputs == faults.stream_error_after:
            raise RuntimeError("injected: the engine stream failed")
        with trio.CancelScope() as scope:
            self._engine._in_flight.add(scope)
            try:
                out = await self._inner.__anext__()
            finally:
                self._engine._in_flight.discard(scope)
        if scope.cancelled_caught:  # only ``close_abruptly`` cancels this scope
            raise ConnectionResetError("injected: the engine went away")
        self._outputs += 1
        if self._faulty:
            self._engine._note_child(out)
        return out

    async def aclose(self) -> None:
        if self._faults.close == "raise":
            raise RuntimeError("injected: closing the engine stream failed")
        if self._faults.close == "hang":
            await trio.sleep_forever()
        await self._inner.aclose()

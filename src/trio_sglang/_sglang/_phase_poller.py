"""``PhasePoller``: one task that watches every request somebody waits on, per engine.

SGLang announces neither a registration nor a dispatch: the only way to
see one is to look at ``rid_to_state`` and the dispatch mark. Each waiter
sleeping and looking for itself costs a task wake-up per waiter per tick
(1,000 requests waiting for their dispatch at a 0.5 ms tick: two million a
second). Here one task, owned by the engine, looks once per tick at every
waited-on rid and wakes only the waiters whose phase changed; with nobody
waiting it does not tick at all.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from .._engine import RequestPhase

__all__ = ["PhasePoller"]


class _Wait:
    __slots__ = ("changed", "phase", "rid")

    def __init__(self, rid: str, phase: RequestPhase) -> None:
        self.rid = rid
        self.phase = phase
        self.changed = trio.Event()


class PhasePoller:
    """Wakes ``wait_change`` callers when ``phase(rid)`` changes; ``run`` is its task."""

    def __init__(self, phase: Callable[[str], RequestPhase], interval: float) -> None:
        self._phase = phase
        self._interval = interval
        self._waits: set[_Wait] = set()
        self._wanted = trio.Event()

    @property
    def waiting(self) -> int:
        return len(self._waits)

    async def wait_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        """Return ``rid``'s phase once it is not ``phase`` (unbounded: callers bound it)."""
        current = self._phase(rid)
        if current is not phase:
            await trio.lowlevel.checkpoint()
            return current
        wait = _Wait(rid, phase)
        self._waits.add(wait)
        self._wanted.set()
        try:
            await wait.changed.wait()
        finally:
            self._waits.discard(wait)
        return self._phase(rid)

    async def run(self) -> None:
        """Tick while anybody waits; sleep until somebody does. Runs until cancelled."""
        while True:
            if not self._waits:
                self._wanted = trio.Event()
                await self._wanted.wait()
            await trio.sleep(self._interval)
            phase = self._phase
            for wait in [w for w in self._waits if phase(w.rid) is not w.phase]:
                self._waits.discard(wait)
                wait.changed.set()

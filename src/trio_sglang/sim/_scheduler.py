"""The SimEngine's scheduler: decodes on its own clock, aborts by prefix, keeps no tombstone.

Modelled on SGLang's scheduler (and on the stand-in scheduler the conformance
tests run against the real TokenizerManager): requests and aborts arrive in
order on one queue and are applied on receipt; an abort stops every request
whose rid starts with the aborted rid; an abort that matches nothing is
simply gone, even if its request arrives a moment later.

``missed_aborts`` injects SGLang's scheduler fault (issue #36876: a request
moving between batches is not found by its abort and decodes on): each
request's first that many aborts pass it by.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from .._kv_rooms import BootstrapAddr
from .._request._values import check_at_least
from ._trace import Trace

__all__ = ["OutputSink", "SimScheduler", "SimTiming"]

#: Receives (rid, new token ids, finish reason or None): the detokenizer's path back.
OutputSink = Callable[[str, list[int], dict[str, Any] | None], None]

VOCAB_SIZE = 64


@dataclass(frozen=True, slots=True)
class SimTiming:
    """Seconds on the trio clock (so ``MockClock`` tests are exact)."""

    tokenize_delay: float
    dispatch_delay: float
    first_token_delay: float
    token_interval: float

    def __post_init__(self) -> None:
        for name in self.__slots__:
            check_at_least(name, getattr(self, name), 0, finite=True)


@dataclass(slots=True, eq=False)
class _Running:
    rid: str
    seed: int
    max_new_tokens: int
    next_time: float
    decoded: int = 0


class SimScheduler:
    def __init__(
        self, timing: SimTiming, trace: Trace, sink: OutputSink, missed_aborts: int = 0
    ) -> None:
        self._timing = timing
        self._missed_aborts = missed_aborts
        #: Aborts each request has missed so far (with ``missed_aborts``).
        self._missed: dict[str, int] = {}
        self._trace = trace
        self._sink = sink
        self._requests: dict[str, _Running] = {}
        self._sorted_rids: list[str] = []  # for prefix matching in O(log n)
        self._due: list[tuple[float, int, _Running]] = []
        self._order = itertools.count()
        self._wakeup = trio.lowlevel.ParkingLot()

    def holds(self, rid: str) -> bool:
        return rid in self._requests

    def rids(self) -> set[str]:
        return set(self._requests)

    def add_request(
        self,
        rid: str,
        seed: int,
        max_new_tokens: int,
        prompt_tokens: int = 0,
        room: int | None = None,
        at: BootstrapAddr | None = None,
    ) -> None:
        """Start decoding ``rid`` (an aggregated engine ignores the prompt and the room)."""
        running = _Running(
            rid, seed, max_new_tokens, trio.current_time() + self._timing.first_token_delay
        )
        self._requests[rid] = running
        insort(self._sorted_rids, rid)
        heapq.heappush(self._due, (running.next_time, next(self._order), running))
        self._wakeup.unpark_all()

    def abort(self, prefix: str) -> None:
        hits = []
        i = bisect_left(self._sorted_rids, prefix)
        while i < len(self._sorted_rids) and self._sorted_rids[i].startswith(prefix):
            hits.append(self._sorted_rids[i])
            i += 1
        if not hits:
            self._trace.record("abort_lost", prefix)
            return
        for rid in hits:
            missed = self._missed.get(rid, 0)
            if missed < self._missed_aborts:
                self._missed[rid] = missed + 1
                self._trace.record("abort_missed", rid)
                continue
            self._remove(rid)
            self._trace.record("abort_applied", rid)
            self._sink(rid, [], {"type": "abort", "message": "Abort by request."})

    async def run(self) -> None:
        """Decode forever; the engine's nursery owns this task.

        Each pass steps every request that is due once, as a decode batch
        does, then yields: a request that fell behind its cadence gets one
        token a pass, not all it is owed at once. Otherwise more requests than
        the process can decode for (thousands at a short ``token_interval``)
        keep this loop busy for good, and nothing else in the process runs.
        """
        while True:
            now = trio.current_time()
            due: list[_Running] = []
            while self._due and self._due[0][0] <= now:
                due.append(heapq.heappop(self._due)[2])
            for running in due:
                if self._requests.get(running.rid) is running:
                    self._step(running, now)
            with trio.move_on_at(self._due[0][0] if self._due else math.inf):
                await self._wakeup.park()

    def _step(self, running: _Running, now: float) -> None:
        if running.decoded < running.max_new_tokens:
            running.decoded += 1
            token = (running.seed + running.decoded * 7919) % VOCAB_SIZE
            self._trace.record("token", running.rid)
            new_ids = [token]
        else:
            new_ids = []
        if running.decoded >= running.max_new_tokens:
            self._remove(running.rid)
            self._trace.record("finished", running.rid)
            self._sink(running.rid, new_ids, {"type": "length", "length": running.decoded})
            return
        # On its cadence; one that fell behind it is not owed the tokens it missed.
        running.next_time = max(running.next_time + self._timing.token_interval, now)
        heapq.heappush(self._due, (running.next_time, next(self._order), running))
        self._sink(running.rid, new_ids, None)

    def _remove(self, rid: str) -> None:
        del self._requests[rid]
        self._missed.pop(rid, None)
        del self._sorted_rids[bisect_left(self._sorted_rids, rid)]

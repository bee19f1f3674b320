"""What a cell costs the process, and what else was going on while it ran.

A slow p99 has three usual suspects besides the code under test, and the
meter records each so that the report can tell them apart: the OS taking the
CPU in the middle of a loop batch (wall time minus this process's CPU time,
per batch), a long batch (its CPU time: many tasks runnable at once), and the
garbage collector (each collection, timed through ``gc.callbacks``). Each is
stamped on the trio clock, so that the report looks only at the window in
which cancels were served.
"""

from __future__ import annotations

import gc
import resource
import time
from dataclasses import dataclass

import trio

__all__ = ["Meter", "Pause"]


@dataclass(frozen=True, slots=True)
class Pause:
    """One loop batch or one collection: when it started (trio clock), and seconds."""

    at: float
    wall: float
    cpu: float

    @property
    def stolen(self) -> float:
        """Wall time the OS did not give this process."""
        return self.wall - self.cpu


class Meter(trio.abc.Instrument):
    """A context manager, used inside ``trio.run``, over one cell."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.wall_s = 0.0
        #: Involuntary context switches: the OS ran something else.
        self.preempted = 0
        self.batches: list[Pause] = []
        self.collections: list[Pause] = []
        self._batch: tuple[float, float, float] | None = None
        self._gc: tuple[float, float, float] | None = None

    def __enter__(self) -> Meter:
        gc.collect()  # so that gc debt from earlier work is not charged to this cell
        trio.lowlevel.add_instrument(self)
        gc.callbacks.append(self._on_gc)
        self._switches = _involuntary_switches()
        self._cpu = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = time.process_time() - self._cpu
        self.wall_s = time.perf_counter() - self._wall
        self.preempted = _involuntary_switches() - self._switches
        gc.callbacks.remove(self._on_gc)
        trio.lowlevel.remove_instrument(self)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc = _stamp()
        elif self._gc is not None:
            self.collections.append(_pause(self._gc))
            self._gc = None

    # -- trio.abc.Instrument: a loop batch runs from after_io_wait to before_io_wait

    def after_io_wait(self, timeout: float) -> None:
        self._batch = _stamp()

    def before_io_wait(self, timeout: float) -> None:
        if self._batch is not None:
            self.batches.append(_pause(self._batch))
            self._batch = None


def _stamp() -> tuple[float, float, float]:
    return trio.current_time(), time.perf_counter(), time.process_time()


def _pause(start: tuple[float, float, float]) -> Pause:
    at, wall, cpu = start
    return Pause(at, time.perf_counter() - wall, time.process_time() - cpu)


def _involuntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw

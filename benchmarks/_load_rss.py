"""The server's resident memory over time: a sample every 0.5 s, then start, peak and end.

Read from ``/proc/<pid>/status`` rather than scraped from ``/metrics``, so
that sampling this often costs the server nothing: a scrape renders every
metric on the server's event loop, the loop whose latency the clients
measure. Linux only, as the server's own ``process_resident_memory_bytes``;
elsewhere the trace stays empty and the figures are ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

__all__ = ["RSS_EVERY", "RssTrace", "resident_bytes"]

#: Seconds between two samples.
RSS_EVERY = 0.5


def resident_bytes(pid: int) -> float | None:
    """``VmRSS`` of process ``pid`` in bytes; None without procfs or once it exited.

    A plain read, called from async code: procfs answers from the kernel's
    memory, without waiting on a disk.
    """
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


@dataclass(slots=True)
class RssTrace:
    """The samples of one stretch of a run, as (seconds since its start, bytes)."""

    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)

    async def run(self) -> None:
        """Sample every ``RSS_EVERY`` s until cancelled, or until there is nothing to read."""
        started = trio.current_time()
        while (rss := resident_bytes(self.pid)) is not None:
            self.samples.append((trio.current_time() - started, rss))
            await trio.sleep(RSS_EVERY)

    @property
    def latest(self) -> float | None:
        return self.samples[-1][1] if self.samples else None

    @property
    def peak(self) -> float | None:
        return max((rss for _, rss in self.samples), default=None)

    def summary(self) -> dict[str, float | None]:
        """The first, largest and last sample, in bytes."""
        first = self.samples[0][1] if self.samples else None
        return {"start": first, "peak": self.peak, "end": self.latest}

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "every_s": RSS_EVERY,
            "samples": [[round(at, 2), round(rss)] for at, rss in self.samples],
        }

"""The server's ``/metrics`` as numbers: one scrape, the difference of two, a histogram's
quantiles; and its resident memory over time, read from ``/proc``.

The load test reads the server only from outside, as an operator would: the
counters it judges the run by (lost aborts, unconfirmed cleanups, live
requests, resident memory) all come from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "RSS_EVERY",
    "Buckets",
    "MissingMetric",
    "RssTrace",
    "Scrape",
    "bucket_delta",
    "histogram_quantile",
]

#: A histogram as (upper bound, cumulative count), ascending, ``+Inf`` last.
Buckets = list[tuple[float, float]]
_Labels = tuple[tuple[str, str], ...]
#: Seconds between two samples of the server's memory.
RSS_EVERY = 0.5


class MissingMetric(LookupError):
    """The server does not export a metric the load test judges it by."""


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape: every sample by name and labels."""

    samples: Mapping[tuple[str, _Labels], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        return cls(
            {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
            }
        )

    def value(self, name: str, **labels: str) -> float:
        """One sample; ``MissingMetric`` if the server does not export it."""
        try:
            return self.samples[name, tuple(sorted(labels.items()))]
        except KeyError:
            raise MissingMetric(f"{name}{labels or ''} is not in /metrics") from None

    def get(self, name: str) -> float | None:
        """An unlabelled sample the server may lack: ``process_*`` exists only on Linux."""
        return self.samples.get((name, ()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed by one label (a labelled counter appears once counted)."""
        found: dict[str, float] = {}
        for (sample, labels), value in self.samples.items():
            key = dict(labels).get(label)
            if sample == name and key is not None:
                found[key] = found.get(key, 0.0) + value
        return found

    def buckets(self, name: str) -> Buckets:
        found = sorted(
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in self.samples.items()
            if sample == f"{name}_bucket"
        )
        if not found:
            raise MissingMetric(f"histogram {name} is not in /metrics")
        return found


def bucket_delta(after: Buckets, before: Buckets) -> Buckets:
    """What was observed between two scrapes of the same histogram."""
    if [bound for bound, _ in after] != [bound for bound, _ in before]:
        raise ValueError("the two scrapes have different buckets")
    return [(bound, count - then) for (bound, count), (_, then) in zip(after, before, strict=True)]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile, by linear interpolation inside the bucket it falls in.

    As Prometheus's ``histogram_quantile``: the samples of a bucket are taken
    as spread evenly between its lower and upper bound (the first bucket's
    lower bound is 0), and a quantile in the ``+Inf`` bucket is reported as the
    largest finite bound. None when nothing was observed.
    """
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q must be in (0, 1], got {q}")
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    raise AssertionError("unreachable: the last bucket holds every sample")


def resident_bytes(pid: int) -> float | None:
    """``VmRSS`` of process ``pid`` in bytes; None without procfs or once it exited.

    Read from ``/proc`` rather than scraped from ``/metrics``, so that sampling this often
    costs the server nothing: a scrape renders every metric on the server's event loop,
    the loop whose latency the clients measure. A plain read, called from async code:
    procfs answers from the kernel's memory, without waiting on a disk.
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
    """The server's memory over one phase and its settle, as (seconds since its start,
    bytes); empty where there is no procfs (Linux only, as ``process_*`` metrics)."""

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

"""The server's ``/metrics`` as numbers: one scrape, the difference of two, a histogram's quantiles.

The load test reads the server only from outside, as an operator would: the
counters it judges the run by (lost aborts, unconfirmed cleanups, live
requests, resident memory) all come from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Buckets", "MissingMetric", "Scrape", "bucket_delta", "histogram_quantile"]

#: A histogram as (upper bound, cumulative count), ascending, ``+Inf`` last.
Buckets = list[tuple[float, float]]
_Labels = tuple[tuple[str, str], ...]


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

"""When did the server let go of each client that left? Read off the in-flight gauge.

A wave of N clients starts with the gauge at a baseline B. Every client's
request ends for the server either because the client left (at its leave
time) or because it finished (at its ``[DONE]``); sort those N end times.
The gauge counts only how many are still held, not which, so releases are
attributed in order: the k-th end is taken as released at the first sample
that was sent after that end and shows at most B + N - k requests in flight.

What this assumes, and what it costs:

- Releases come in the order the clients went (first in, first out). A
  server that releases out of order gets the same set of latencies, sorted
  differently among the clients, so percentiles hold but per-client pairing
  does not.
- The wave's requests are the only traffic. Another client's request
  arriving or leaving moves the gauge and the attribution with it.
- Resolution: a release is known only to within the time between two
  samples plus one scrape; the latency reported is from the end to the
  middle of the first sample that shows it, so it can be late by up to one
  sampling interval, and a release faster than that reads as about half of it.
- A request the gauge never showed (it left before the server counted it,
  or came and went between two samples) adds no step: it is counted as
  ``unseen``, and the attribution gives it the first sample after its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._sampler import Sample

__all__ = ["Releases", "attribute_releases"]


@dataclass(frozen=True, slots=True)
class Releases:
    #: For each end in time order: when the gauge showed it released (a sample's
    #: midpoint), or None if it never did in the samples given.
    released_at: list[float | None]
    #: How far above the baseline the gauge ever rose: the wave's requests it saw at once.
    peak: float
    #: Requests of the wave the gauge never showed held at the same time (N - peak).
    unseen: int


def attribute_releases(
    ends: Sequence[float], baseline: float, samples: Sequence[Sample]
) -> Releases:
    """``ends`` in time order; ``samples`` in time order, from the wave's start on."""
    count = len(ends)
    released: list[float | None] = []
    position = 0
    for k, end in enumerate(ends, start=1):
        # Ends and thresholds both move one way, so the search resumes where the last stopped.
        limit = baseline + count - k + 0.5  # gauges are floats; counts are whole
        while position < len(samples) and not (
            samples[position].sent >= end and samples[position].in_flight < limit
        ):
            position += 1
        released.append(samples[position].at if position < len(samples) else None)
    peak = max((sample.in_flight for sample in samples), default=baseline) - baseline
    unseen = max(0, count - round(peak))
    return Releases(released, peak, unseen)

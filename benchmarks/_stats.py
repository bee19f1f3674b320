"""The benchmarks' one percentile: nearest rank, as ``trio-sglang bench-endpoint`` reports it.

Nearest rank, never interpolated: every p50 or p99 a benchmark prints is a
latency some stream really had, and the figures of two benchmarks, or of a
benchmark and ``bench-endpoint``, compare as like with like.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trio_sglang.bench_endpoint._report import percentile

__all__ = ["Stats", "percentile", "percentiles"]

Stats = dict[str, float | None]


def percentiles(samples: Sequence[float]) -> Stats:
    """p50, p99 and max.

    Infinite samples (never stopped) stay infinite and come out as ``None``.
    """

    def rank(p: float) -> float | None:
        value = percentile(samples, p)
        return None if value is None or math.isinf(value) else value

    return {"p50": rank(0.50), "p99": rank(0.99), "max": rank(1.0)}

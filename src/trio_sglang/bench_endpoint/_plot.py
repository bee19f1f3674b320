"""The PNG: release latency per phase, and the in-flight gauge over the run with every leave.

Drawn with what every latency figure shares (``_figures.py``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._figures import latency_box, log_ms_axis, pyplot, save
from ._report import Report

# At import: without the bench extra, ``bench-endpoint`` refuses before it runs.
pyplot()

__all__ = ["plot"]

#: A log axis has no zero: faster releases are drawn at this.
_FLOOR_MS = 0.1


def plot(report: Report, path: Path) -> None:
    fig, (latency, timeline) = pyplot().subplots(2, 1, figsize=(12, 8.5))
    _latency(latency, report)
    _timeline(timeline, report)
    fig.suptitle(
        f"bench-endpoint: {report.server} at {report.url}, {report.concurrency} at once "
        f"(a sample every {report.sample_every_ms:.1f} ms)",
        fontsize=11,
    )
    fig.tight_layout()
    save(fig, path)


def _latency(ax: Any, report: Report) -> None:
    phases = [phase for phase in report.phases if phase.name != "stay"]
    log_ms_axis(ax)
    for x, phase in enumerate(phases):
        color = "#1b9e77" if phase.name.endswith("close") else "#7570b3"
        latency_box(
            ax, x, phase.release_ms, color, width=0.6, floor_ms=_FLOOR_MS,
            missing=phase.leaked, max_color="black",
        )  # fmt: skip
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels([phase.name.replace(":", "\n") for phase in phases], fontsize=8)
    ax.set_xlim(-0.5, max(len(phases), 1) - 0.5)
    ax.set_ylabel("ms from leaving to release (log)")
    ax.set_title(
        "release after the client left: boxes p25-p75, whiskers p1-p99, x = max "
        "(green: clean close, purple: reset)",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)


def _timeline(ax: Any, report: Report) -> None:
    times = report.timeline["t"]
    ax.step(times, report.timeline["in_flight"], where="post", color="black", lw=0.8)
    top = max((value or 0.0 for value in report.timeline["in_flight"]), default=1.0)
    for number, phase in enumerate(report.phases, start=1):
        start, end = phase.window
        ax.axvspan(start, end, color="#eeeeee" if number % 2 else "#f8f8f8", zorder=0)
        # Numbers, not names: the leaving phases are short beside the control.
        ax.text((start + end) / 2, top * 1.05, str(number), ha="center", va="bottom", fontsize=8)
        _rug(ax, phase.leaves)
    ax.set_ylim(0, top * 1.25 + 1)
    key = ", ".join(f"{number} {phase.name}" for number, phase in enumerate(report.phases, 1))
    ax.set_xlabel(textwrap.fill(f"seconds from the start of the run; phases: {key}", 150))
    ax.set_ylabel(f"in flight ({report.holds})")
    ax.set_title("the server's in-flight gauge; ticks at the bottom: clients leaving", fontsize=10)


def _rug(ax: Any, leaves: Sequence[float]) -> None:
    if leaves:
        ax.plot(leaves, [0.0] * len(leaves), "|", color="#d95f02", markersize=10)

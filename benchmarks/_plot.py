"""The PNG: latency distributions per approach, phase and concurrency, on a log scale
(the at-once bursts on a linear one, from 0).

Drawn with what every latency figure shares (``trio_sglang.bench_endpoint._figures``),
which imports matplotlib only when a figure is drawn: without it a run says so
in one line and writes no PNG (``pip install -e .[bench]`` brings matplotlib).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _metrics import CellResult
from trio_sglang.bench_endpoint._figures import latency_box, log_ms_axis, pyplot, save

__all__ = ["figure", "plot"]

#: Samples below this are drawn at it: a log axis has no zero (a request the
#: engine never held has an abort delay of exactly 0).
FLOOR_MS = 1e-3
COLORS = {"trio-sglang": "#1b9e77", "first-response": "#d95f02", "poll-then-abort": "#7570b3"}
#: (samples, title, target in ms, y-axis label)
PANELS = (
    ("stream_close_ms", "caller's stream closed after the cancel", 1.0, "stream closed"),
    ("abort_delay_ms", "engine let go, after max(cancel, dispatch)", 2.0, "engine let go"),
)
#: The at-once scenario's target is "all stopped within 1 s", for both panels.
AT_ONCE_TARGET_MS = 1000.0


def plot(cells: Sequence[CellResult], path: Path) -> None:
    save(figure(cells), path)


def figure(cells: Sequence[CellResult]) -> Any:
    """The matplotlib figure: a row per phase, a panel per measure."""
    plt = pyplot()
    phases = list(dict.fromkeys(cell.phase for cell in cells))
    approaches = [name for name in COLORS if any(cell.approach == name for cell in cells)]
    fig, axes = plt.subplots(
        len(phases), len(PANELS), figsize=(15, 3.4 * len(phases) + 1), squeeze=False
    )
    for row, phase in enumerate(phases):
        in_phase = [cell for cell in cells if cell.phase == phase]
        burst = phase.startswith("at_once")
        for column, (samples, title, target, label) in enumerate(PANELS):
            ax = axes[row][column]
            _panel(ax, in_phase, approaches, samples, linear=burst)
            ax.axhline(AT_ONCE_TARGET_MS if burst else target, color="red", ls="--", lw=0.8)
            ax.set_title(f"{phase}: {title}", fontsize=10)
            # Each panel names its own measure; the burst's are linear, from 0, so that
            # their ticks can be read (a log axis spanning under a decade labels one).
            ax.set_ylabel(f"{label}, ms after the cancel" if burst else f"{label}, ms (log)")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS[name], alpha=0.6, label=name)
        for name in approaches
    ]
    handles.append(plt.Line2D([], [], color="red", linestyle="--", label="target"))
    fig.suptitle(
        "Cancel latency on SimEngine, real time. Boxes p25-p75, whiskers p1-p99, x = max; "
        f"0 ms is drawn at {FLOOR_MS:g} ms; 'never' = still held by the engine at the end",
        fontsize=11,
        y=0.997,
        va="top",
    )
    top = 1 - 0.9 / fig.get_figheight()  # room for the title and the legend, in inches
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, top), ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def _panel(
    ax: Any, cells: Sequence[CellResult], approaches: Sequence[str], samples: str, *, linear: bool
) -> None:
    from matplotlib import ticker

    sizes = sorted({cell.concurrency for cell in cells})
    width = 0.8 / max(1, len(approaches))
    if not linear:
        log_ms_axis(ax)
    for group, size in enumerate(sizes):
        for slot, name in enumerate(approaches):
            found = [c for c in cells if c.concurrency == size and c.approach == name]
            if not found:
                continue
            x = group + (slot - (len(approaches) - 1) / 2) * width
            values = getattr(found[0], samples)
            finite = [value for value in values if not math.isinf(value)]
            latency_box(
                ax, x, finite, COLORS[name], width=width * 0.85, floor_ms=FLOOR_MS,
                missing=len(values) - len(finite), missing_word="never\nstopped",
            )  # fmt: skip
    if linear:
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(ticker.MaxNLocator(6))
    else:
        low, high = ax.get_ylim()
        # Within a decade or so a log axis has one labelled tick or none: label 2 and 5 too.
        some = ticker.FuncFormatter(
            lambda value, _: f"{value:g}" if _mantissa(value) in (2, 5) else ""
        )
        ax.yaxis.set_minor_formatter(some if high / low < 30 else ticker.NullFormatter())
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{size:,} stream{'s' if size > 1 else ''}" for size in sizes])
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.grid(axis="y", which="major", alpha=0.3)


def _mantissa(value: float) -> int:
    return round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0

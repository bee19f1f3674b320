"""What every latency figure of this project shares, ``bench-endpoint``'s and the benchmarks'.

matplotlib on its file-only backend, or one clear error when it is missing
(the bench extra brings it); the box a latency distribution is drawn as; a
log axis in milliseconds; and writing the PNG. One definition, so that a
box reads the same (p25 to p75, whiskers p1 to p99, x the maximum) in every
figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MissingPlotDependency", "latency_box", "log_ms_axis", "pyplot", "save"]


class MissingPlotDependency(ImportError):
    """The PNG needs matplotlib, which the ``bench`` extra installs."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only backend, or ``MissingPlotDependency``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingPlotDependency(
            "the PNG needs matplotlib: install the bench extra (pip install 'trio-sglang[bench]')"
        ) from exc
    return plt


def latency_box(
    ax: Any,
    x: float,
    values: Sequence[float],
    color: str,
    *,
    width: float,
    floor_ms: float,
    missing: int = 0,
    missing_word: str = "leaked",
    max_color: str | None = None,
) -> None:
    """One distribution at ``x``: a box p25 to p75, whiskers p1 to p99, an x at the maximum.

    A log axis has no zero: a value under ``floor_ms`` is drawn at it.
    ``missing`` samples that never ended (a request never stopped) are
    written above the box instead, in red: they are the failures.
    """
    drawn = [max(value, floor_ms) for value in values]
    if drawn:
        box = ax.boxplot(
            [drawn], positions=[x], widths=width, whis=(1, 99), showfliers=False,
            patch_artist=True, manage_ticks=False,
        )  # fmt: skip
        for patch in box["boxes"]:
            patch.set(facecolor=color, alpha=0.6)
        for line in box["medians"]:
            line.set(color="black")
        ax.plot([x], [max(drawn)], marker="x", color=max_color or color, markersize=6)
    if missing:
        ax.annotate(
            f"{missing} {missing_word}", (x, 0.97), xycoords=("data", "axes fraction"),
            ha="center", va="top", fontsize=8, fontweight="bold", color="red",
        )  # fmt: skip


def log_ms_axis(ax: Any) -> None:
    """A log y axis whose ticks read as plain milliseconds (``0.5``, ``20``), not powers."""
    from matplotlib import ticker

    ax.set_yscale("log")
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` as a PNG at ``path`` (its folder made), and free it."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)

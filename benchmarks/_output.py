"""What every benchmark's output is made of: the progress bar, text and Markdown
tables, the targets block, the machine a run ran on, and the files in its folder.

Each benchmark's report (``_report.py``, ``_throughput_report.py``,
``disagg_cancel.py``, the load reports, ...) says what it measured with these,
through the base they share (``_report_base.py``); none of them knows another's.
Text on stdout fits in ``WIDTH`` columns. A run's folder (``results_folder``)
holds its JSON and ``summary.md``, to which each benchmark adds its own section
(``append_summary``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from _verdict import Target

__all__ = [
    "RESULTS_ROOT",
    "WIDTH",
    "Progress",
    "add_file_options",
    "append_summary",
    "cores",
    "machine",
    "markdown_table",
    "number",
    "results_folder",
    "table",
    "target_lines",
    "wrap",
    "write_json",
]

#: The widest line a table or a paragraph on stdout may have.
WIDTH = 100
#: Where a run's folder goes, under the current directory: ``bench-results/<UTC time>/``.
RESULTS_ROOT = Path("bench-results")
STAMP = "%Y-%m-%dT%H-%M-%SZ"


class Progress:
    """A one-line progress bar on stderr: steps done, elapsed time, what runs now.

    On a terminal the line is redrawn in place; elsewhere (CI logs) each step
    gets its own line, so the log still shows how far it got.
    """

    WIDTH = 24

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self._total = max(1, total)
        self._done = 0
        self._stream = sys.stderr if stream is None else stream
        self._tty = self._stream.isatty()
        self._started = time.perf_counter()

    def start(self, label: str) -> None:
        filled = self.WIDTH * self._done // self._total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        elapsed = time.perf_counter() - self._started
        line = f"[{bar}] {self._done}/{self._total} {elapsed:6.1f} s  {label}"
        if self._tty:
            self._stream.write(f"\r\x1b[K{line}")
        else:
            self._stream.write(f"{line}\n")
        self._stream.flush()

    def step_done(self) -> None:
        self._done += 1

    def finish(self) -> None:
        if self._tty:
            self._stream.write("\r\x1b[K")
        elapsed = time.perf_counter() - self._started
        self._stream.write(f"done: {self._done} steps in {elapsed:.1f} s\n")
        self._stream.flush()


# -- the machine ---------------------------------------------------------------------


def cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine() -> dict[str, Any]:
    """The ``machine`` every results JSON records: versions, platform, CPUs, memory, date."""
    import trio

    import trio_sglang as ts

    memory = None
    try:
        with open("/proc/meminfo") as meminfo:
            kib = int(meminfo.readline().split()[1])
        memory = f"{kib / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory": memory,
        "trio": trio.__version__,
        "trio_sglang": ts.__version__,
        "date": datetime.date.today().isoformat(),
    }


# -- the files -----------------------------------------------------------------------


def results_folder(out: Path | None = None) -> Path:
    """``out`` (created if needed), or a new ``bench-results/<UTC time>/`` of this run's own."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        return out
    stamp = time.strftime(STAMP, time.gmtime())
    for attempt in range(1, 100):
        folder = RESULTS_ROOT / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"{RESULTS_ROOT / stamp}: 99 runs in one second")


def add_file_options(parser: argparse.ArgumentParser, files: str) -> None:
    """``--out DIR`` (the run's folder, for ``files``) and ``--json PATH`` (an override)."""
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"the folder for {files} (default: a new {RESULTS_ROOT}/<UTC time>/)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write the JSON here instead (default DIR)"
    )


def number(
    kind: Callable[[str], float], low: float, high: float = math.inf, *, above: bool = False
) -> Callable[[str], Any]:
    """An argparse type: ``kind`` of the option's text, at least ``low`` (above it, with
    ``above``) and at most ``high``; every benchmark's options are checked by one of these."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value > low if above else value >= low) or not value <= high:
            bounds = f"> {low:g}" if above else f">= {low:g}"
            if high < math.inf:
                bounds = f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


def write_json(path: Path, data: Any) -> Path:
    """``data`` at ``path`` (its folder created if needed), indented, ending in a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def append_summary(folder: Path, section: str) -> Path:
    """``section`` at the end of the folder's ``summary.md``, a blank line after what is there."""
    summary = folder / "summary.md"
    with summary.open("a") as out:
        out.write(("\n" if out.tell() else "") + section)
    return summary


# -- text: tables and paragraphs that fit in WIDTH columns ----------------------------


def wrap(text: str, hang: int = 0) -> list[str]:
    """``text`` in lines of at most ``WIDTH``; lines after the first indented by ``hang``."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=" " * hang) or [""]


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[str] | str],
    *,
    align: str = "",
    groups: Sequence[tuple[str, int]] = (),
) -> list[str]:
    """Columns two spaces apart; a ``str`` in ``rows`` is a heading line across the table.

    ``align``: one ``l`` or ``r`` per column (default: the first left, the rest
    right). ``groups``: (label, columns) spans, centred on a line above the header.
    """
    cells = [row for row in rows if not isinstance(row, str)]
    widths = [max(len(cell) for cell in column) for column in zip(header, *cells, strict=True)]
    align = align or "l" + "r" * (len(header) - 1)

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if side == "l" else cell.rjust(width)
            for cell, width, side in zip(row, widths, align, strict=True)
        ).rstrip()

    lines = []
    if groups:
        spans, first = [], 0
        for label, count in groups:
            span = sum(widths[first : first + count]) + 2 * (count - 1)
            spans.append(label.center(span) if label else " " * span)
            first += count
        lines.append("  ".join(spans).rstrip())
    lines += [line(header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [row if isinstance(row, str) else line(row) for row in rows]
    return lines


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        f"| {' | '.join(header)} |",
        f"|{'|'.join(' --- ' for _ in header)}|",
        *(f"| {' | '.join(row)} |" for row in rows),
    ]


#: A space that ``textwrap`` does not break at (it splits at ASCII whitespace only).
_KEEP = "\N{NO-BREAK SPACE}"


def target_lines(targets: Iterable[Target]) -> list[str]:
    """Each target's line (``[met]  what: measured (target ...)``) in ``WIDTH`` columns,
    wrapped between its parts, or after a ``;`` inside one, rather than inside a figure,
    under its verdict."""
    lines = []
    for target in targets:
        text = target.line(keep=lambda part: part.replace(" ", _KEEP).replace(f";{_KEEP}", "; "))
        lines += [line.replace(_KEEP, " ") for line in wrap(text, hang=15)]
    return lines

"""What a person reads: the progress line while it runs, the tables, the SPEC targets, the JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from _metrics import CellResult, Stats, percentiles

__all__ = ["Progress", "Report", "Target", "format_report", "targets", "write_json"]


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


@dataclass(slots=True)
class Report:
    """Everything one run measured."""

    config: dict[str, Any]
    results: list[CellResult] = field(default_factory=list)
    at_once: list[CellResult] = field(default_factory=list)
    throughput: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    shutdown: dict[str, Any] | None = None
    #: The machine's 1-minute load average before and after the run: above ~1 on
    #: 2 cores, something else competed for the CPU and tails are inflated.
    load_average: tuple[float, float] = (0.0, 0.0)
    #: The worker's log records during the run, counted by message template.
    worker_log: dict[str, int] = field(default_factory=dict)
    runtime_s: float = 0.0

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {
            "results": [cell.to_json() for cell in self.results],
            "throughput_ratio": None if self.throughput is None else self.throughput["ratio"],
            "throughput": self.throughput,
            "memory": self.memory,
            "at_once": [cell.to_json() for cell in self.at_once],
            "shutdown": self.shutdown,
            "worker_log": self.worker_log,
            "load_average": {"before": self.load_average[0], "after": self.load_average[1]},
            "targets": [target.to_json() for target in targets(self)],
            "config": self.config,
            "machine": machine,
            "runtime_s": round(self.runtime_s, 1),
        }


def write_json(report: Report, path: Path, machine: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(machine), indent=2) + "\n")


# -- the tables --------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "never"
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _triple(stats: Stats, fmt: Callable[[float | None], str] = _ms) -> str:
    return "/".join(fmt(stats[key]) for key in ("p50", "p99", "max"))


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


_HEADER = (
    f"{'phase':<19} {'streams':>7} {'approach':<15} {'cancels':>7} "
    f"{'close ms p50/p99/max':>22} {'abort delay ms p50/p99/max':>27} "
    f"{'lost':>5} {'leaked':>6} {'wasted p50/p99/max':>18} {'cpu us':>7} {'off':>4} "
    f"{'stall':>6} {'batch':>6} {'gc':>6}"
)


def _row(cell: CellResult) -> str:
    return (
        f"{cell.phase:<19} {cell.concurrency:>7} {cell.approach:<15} {cell.cancels:>7} "
        f"{_triple(percentiles(cell.stream_close_ms)):>22} "
        f"{_triple(percentiles(cell.abort_delay_ms)):>27} "
        f"{cell.aborts_lost:>5} {cell.leaked:>6} "
        f"{_triple(percentiles(cell.wasted_tokens), _count):>18} "
        f"{cell.cpu_us_per_cancel:>7.0f} {cell.off_phase:>4} "
        f"{cell.stall_max_ms:>6.1f} {cell.batch_max_ms:>6.1f} {cell.gc_max_ms:>6.1f}"
    )


def _cells_table(cells: Sequence[CellResult]) -> list[str]:
    lines = [_HEADER, "-" * len(_HEADER)]
    previous = ""
    for cell in cells:
        if previous and cell.phase != previous:
            lines.append("")
        previous = cell.phase
        lines.append(_row(cell))
    return lines


def format_report(report: Report) -> str:
    lines = ["Cancel latency (trio clock, real time; 'never' = still held at the end)", ""]
    lines += _cells_table(report.results)
    if report.at_once:
        lines += ["", "All streams cancelled in one instant:", ""]
        lines += _cells_table(report.at_once)
    lines += ["", *_overhead_lines(report), "", "SPEC targets:", ""]
    lines += [target.line() for target in targets(report)]
    return "\n".join(lines)


def _overhead_lines(report: Report) -> list[str]:
    cells = report.results + report.at_once
    before, after = report.load_average
    preempted = sum(cell.preempted for cell in cells)
    lines = [
        f"machine: load average {before:.2f} before, {after:.2f} after; the OS preempted this "
        f"process {preempted:,} times during the cells. Per cell, in ms, while cancels were "
        "served: 'stall' = the longest the OS held the CPU away within one event-loop batch, "
        "'batch' = the most CPU one batch used, 'gc' = the longest garbage collection"
    ]
    if report.throughput is not None:
        t = report.throughput
        lines.append(
            f"throughput: worker {t['worker_tokens_per_s']:,.0f} tok/s, direct "
            f"{t['direct_tokens_per_s']:,.0f} tok/s, ratio {t['ratio']:.3f} ({t['method']}; "
            f"median per-round ratio {t['median_round_ratio']:.3f})"
        )
    if report.memory is not None:
        m = report.memory
        lines.append(
            f"memory: {m['bytes_per_request']:,.0f} bytes per in-flight request through the "
            f"worker ({m['streams']:,} streams, {m['method']})"
        )
    if report.shutdown is not None:
        s = report.shutdown
        lines.append(
            f"shutdown: {s['shutdown_ms']:.0f} ms with {s['pending_cleanups']:,} pending cleanups "
            f"(grace {1e3 * s['grace_s']:.0f} ms, {s['over_grace_ms']:.0f} ms over it)"
        )
    return lines


# -- the SPEC targets --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    what: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run

    def line(self) -> str:
        verdict = {True: "met", False: "MISSED", None: "not run"}[self.met]
        return f"  [{verdict:>7}] {self.what}: target {self.target}; measured {self.measured}"

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "target": self.target,
            "measured": self.measured,
            "met": self.met,
        }


def _ours(cells: Iterable[CellResult]) -> list[CellResult]:
    return [cell for cell in cells if cell.approach == "trio-sglang"]


def _worst(cells: Sequence[CellResult], samples: str, key: str = "p99") -> float | None:
    """The worst ``key`` percentile of ``samples`` over (non-empty) ``cells``; None if infinite."""
    values = [percentiles(getattr(cell, samples))[key] for cell in cells]
    if any(value is None for value in values):
        return None
    return max(value for value in values if value is not None)


def _at_scale(cells: Sequence[CellResult], wanted: int) -> tuple[list[CellResult], int]:
    """trio-sglang's cells at ``wanted`` streams, or at the largest concurrency that ran."""
    ours = _ours(cells)
    sizes = {cell.concurrency for cell in ours}
    size = wanted if wanted in sizes else max(sizes, default=0)
    return [cell for cell in ours if cell.concurrency == size], size


def _latency_target(what: str, limit: float, cells: Sequence[CellResult], samples: str) -> Target:
    chosen, size = _at_scale(cells, 1000)
    if not chosen:
        return Target(what, f"p99 <= {limit:g} ms", "not run", None)
    worst = _worst(chosen, samples)
    measured = f"worst p99 over phases {_ms(worst)} ms at {size:,} streams"
    return Target(what, f"p99 <= {limit:g} ms", measured, worst is not None and worst <= limit)


def targets(report: Report) -> list[Target]:
    ours = _ours(report.results)
    found = [
        _latency_target(
            "caller's stream closed after cancel (any phase, 1,000 streams)",
            1.0,
            report.results,
            "stream_close_ms",
        ),
        _latency_target(
            "extra abort delay beyond the wait for dispatch",
            2.0,
            report.results,
            "abort_delay_ms",
        ),
        _lost_and_leaked(ours + _ours(report.at_once)),
        _wasted(ours),
        _throughput(report.throughput),
        _at_once(_ours(report.at_once)),
        _memory(report.memory),
        _shutdown(report.shutdown),
    ]
    return found


def _lost_and_leaked(cells: Sequence[CellResult]) -> Target:
    what, target = "aborts lost / requests leaked at random moments", "0 / 0 over >= 10,000 cancels"
    if not cells:
        return Target(what, target, "not run", None)
    cancels = sum(cell.cancels for cell in cells)
    lost = sum(cell.aborts_lost for cell in cells)
    leaked = sum(cell.leaked for cell in cells)
    measured = f"{lost} / {leaked} over {cancels:,} cancels"
    return Target(what, target, measured, lost == 0 and leaked == 0 and cancels >= 10_000)


def _wasted(cells: Sequence[CellResult]) -> Target:
    what, target = "decode tokens generated after the cancel", "<= 1 per request at p99"
    if not cells:
        return Target(what, target, "not run", None)
    worst = _worst(cells, "wasted_tokens")
    worst_max = _worst(cells, "wasted_tokens", "max")
    measured = f"worst p99 {_count(worst)}, worst max {_count(worst_max)} (all cells)"
    return Target(what, target, measured, worst is not None and worst <= 1)


def _throughput(throughput: dict[str, Any] | None) -> Target:
    what, target = "tokens/s through worker.generate vs the engine directly", ">= 0.9"
    if throughput is None:
        return Target(what, target, "not run", None)
    ratio = float(throughput["ratio"])
    measured = f"{ratio:.3f} (median per-round {throughput['median_round_ratio']:.3f})"
    return Target(what, target, measured, ratio >= 0.9)


def _at_once(cells: Sequence[CellResult]) -> Target:
    what, target = "streams cancelled at once, all stopped", "within 1 s for 10,000"
    plain = [cell for cell in cells if cell.phase == "at_once"]  # not the tuned gc variant
    if not plain:
        return Target(what, target, "not run", None)
    cell = plain[0]
    closed = percentiles(cell.stream_close_ms)["max"]
    stopped = percentiles(cell.abort_delay_ms)["max"]
    worst = None if closed is None or stopped is None else max(closed, stopped)
    measured = (
        f"{cell.concurrency:,} streams: last stream closed {_ms(closed)} ms, "
        f"last request stopped at the engine {_ms(stopped)} ms"
    )
    met = worst is not None and worst <= 1000 and cell.concurrency >= 10_000
    return Target(what, target, measured, met)


def _memory(memory: dict[str, Any] | None) -> Target:
    what, target = "worker memory per in-flight request", "<= 10 KB"
    if memory is None:
        return Target(what, target, "not run", None)
    per = float(memory["bytes_per_request"])
    measured = f"{per / 1024:.2f} KiB ({memory['streams']:,} streams)"
    return Target(what, target, measured, per <= 10 * 1024)


def _shutdown(shutdown: dict[str, Any] | None) -> Target:
    what, target = "worker shutdown with 1,000 pending detached aborts", "within grace + 50 ms"
    if shutdown is None:
        return Target(what, target, "not run", None)
    over = float(shutdown["over_grace_ms"])
    measured = (
        f"{shutdown['shutdown_ms']:.0f} ms with grace {1e3 * shutdown['grace_s']:.0f} ms "
        f"({over:.0f} ms over, {shutdown['pending_cleanups']:,} pending)"
    )
    return Target(what, target, measured, over <= 50 and shutdown["pending_cleanups"] >= 1000)

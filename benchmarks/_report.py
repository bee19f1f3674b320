"""What the cancel-latency benchmark says: its ratios, its nine targets, its tables.

stdout opens with trio-sglang against the two baselines as ratios measured in
the same run, then the targets with their verdicts (judged by ``_verdict.py``'s
rule), then the detail tables; every table fits in 100 columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from _metrics import CellResult
from _output import markdown_table, table, target_lines, wrap
from _report_base import BenchReport, Column, columns_table
from _stats import percentiles
from _units import count, ms, ratio
from _verdict import MachineState, Target, judge_machine

__all__ = ["Report", "summary_markdown", "targets"]


@dataclass(slots=True)
class Report(BenchReport):
    """Everything one run measured."""

    config: dict[str, Any]
    results: list[CellResult] = field(default_factory=list)
    at_once: list[CellResult] = field(default_factory=list)
    throughput: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    shutdown: dict[str, Any] | None = None
    #: The machine's 1-minute load average before and after the run.
    load_average: tuple[float, float] = (0.0, 0.0)
    #: The cores this process may run on.
    cores: int = 1
    #: This process's CPU seconds over the run (its own share of the load average).
    cpu_s: float = 0.0
    #: The worker's log records during the run, counted by message template.
    worker_log: dict[str, int] = field(default_factory=dict)
    runtime_s: float = 0.0

    @property
    def cells(self) -> list[CellResult]:
        return self.results + self.at_once

    @property
    def machine_state(self) -> MachineState:
        own = self.cpu_s / self.runtime_s if self.runtime_s else 0.0
        stall = max((cell.stall_max_ms for cell in self.cells), default=0.0)
        return judge_machine(*self.load_average, self.cores, own, stall)

    def targets(self) -> list[Target]:
        return targets(self, self.machine_state)

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {
            "results": [cell.to_json() for cell in self.results],
            "ratios": ratios(self.cells),
            "throughput_ratio": None if self.throughput is None else self.throughput["ratio"],
            "throughput": self.throughput,
            "memory": self.memory,
            "at_once": [cell.to_json() for cell in self.at_once],
            "shutdown": self.shutdown,
            "worker_log": self.worker_log,
            "load_average": {"before": self.load_average[0], "after": self.load_average[1]},
            "machine_state": self.machine_state.to_json(),
            "targets": self.targets_json(),
            "config": self.config,
            "machine": machine,
            "runtime_s": round(self.runtime_s, 1),
            "cpu_s": round(self.cpu_s, 1),
        }

    def lines(self) -> list[str]:
        """Ratios first, then the targets, then the details; no line wider than ``WIDTH``."""
        top = headline_ratios(self.cells)
        size = next((row["concurrency"] for row in top if row["phase"] != "at_once"), 0)
        lines = [
            "Cancel latency: trio-sglang against Dynamo's two strategies (SimEngine, real time)",
            *wrap(legend(short=True)),
            "",
            *wrap(
                f"p99 per phase at {size:,} streams, and the at-once burst: trio-sglang in ms, "
                "each baseline as its p99 over trio-sglang's, measured in this run (3.0x: three "
                "times longer; never: it left requests running)"
            ),
            "",
            *_ratio_table(self.cells),
            "",
            "targets (counts judged always; times only on a quiet machine):",
            *target_lines(self.targets()),
            *wrap(self.machine_state.line()),
            "",
            *wrap(
                "Every cell, in ms (p50/p99): 'close' = the caller's stream closed after the "
                "cancel, 'abort' = the engine let go after max(cancel, dispatch), 'never' = still "
                "held at the end; 'wasted' = tokens decoded after the cancel (p99); 'cpu us' per "
                "cancel; 'off' = cancels that landed in another phase."
            ),
            "",
            *_cells_table(self.results),
        ]
        if self.at_once:
            lines += ["", "All streams cancelled in one instant:", ""]
            lines += _cells_table(self.at_once)
        lines += ["", *_overhead_lines(self)]
        return lines


# -- the nine targets ------------------------------------------------------------------


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
    what, target = f"{what} p99 at 1,000 streams", f"<= {limit:g} ms"
    if not chosen:
        return Target(what, target, "not run", None, "time")
    worst = _worst(chosen, samples)
    where = "" if size == 1000 else f" at {size:,} streams"
    measured = f"{ms(worst)} ms{where} (worst phase)"
    return Target(what, target, measured, worst is not None and worst <= limit, "time")


def targets(report: Report, machine: MachineState | None = None) -> list[Target]:
    """The nine targets, judged on ``machine`` (unjudged raw verdicts when None)."""
    ours = _ours(report.results)
    found = [
        _latency_target("stream close", 1.0, report.results, "stream_close_ms"),
        _close_at_scale(report.results),
        _latency_target("abort delay", 2.0, report.results, "abort_delay_ms"),
        _lost_and_leaked(ours + _ours(report.at_once)),
        _wasted(ours),
        _throughput(report.throughput),
        _at_once(_ours(report.at_once)),
        _memory(report.memory),
        _shutdown(report.shutdown),
    ]
    return found if machine is None else [target.judged_on(machine) for target in found]


def _lost_and_leaked(cells: Sequence[CellResult]) -> Target:
    what, target = "aborts lost / requests leaked", "0 / 0, >= 10,000 cancels"
    if not cells:
        return Target(what, target, "not run", None, "count")
    cancels = sum(cell.cancels for cell in cells)
    lost = sum(cell.aborts_lost for cell in cells)
    leaked = sum(cell.leaked for cell in cells)
    measured = f"{lost} / {leaked} over {cancels:,} cancels"
    return Target(what, target, measured, lost == 0 and leaked == 0 and cancels >= 10_000, "count")


def _wasted(cells: Sequence[CellResult]) -> Target:
    what, target = "tokens decoded after a cancel", "p99 <= 1"
    if not cells:
        return Target(what, target, "not run", None, "count")
    worst = _worst(cells, "wasted_tokens")
    worst_max = _worst(cells, "wasted_tokens", "max")
    measured = f"worst p99 {count(worst)}, max {count(worst_max)}"
    return Target(what, target, measured, worst is not None and worst <= 1, "count")


def _throughput(throughput: dict[str, Any] | None) -> Target:
    what, target = "tokens/s through the worker / direct", ">= 0.9"
    if throughput is None:
        return Target(what, target, "not run", None, "time")
    found = float(throughput["ratio"])
    measured = f"{found:.3f} (median of rounds {throughput['median_round_ratio']:.3f})"
    return Target(what, target, measured, found >= 0.9, "time")


def _at_once(cells: Sequence[CellResult]) -> Target:
    what, target = "10,000 streams cancelled at once", "all stopped <= 500 ms"
    plain = [cell for cell in cells if cell.phase == "at_once"]  # not the tuned gc variant
    if not plain:
        return Target(what, target, "not run", None, "time")
    cell = plain[0]
    worst = cell.all_stopped_ms
    measured = f"{cell.concurrency:,} stopped in {ms(worst)} ms"
    for key, floor_is in (("trio_floor_ms", "bare trio"), ("engine_floor_ms", "the engine alone")):
        floor = cell.extra.get(key)
        if floor and worst is not None:
            measured += f"; {floor_is} {ms(floor)} ms ({worst / floor:.1f}x)"
    met = worst is not None and worst <= 500 and cell.concurrency >= 10_000
    return Target(what, target, measured, met, "time")


def _close_at_scale(cells: Sequence[CellResult]) -> Target:
    """The sweep's largest cells (``--full``): the stream still closes within 1 ms."""
    what, target = "stream close p99 at 10,000 streams", "<= 1 ms"
    chosen = [cell for cell in _ours(cells) if cell.concurrency >= 10_000]
    if not chosen:
        return Target(what, target, "not run (--full runs it)", None, "time")
    worst = _worst(chosen, "stream_close_ms")
    measured = f"{ms(worst)} ms (worst phase)"
    return Target(what, target, measured, worst is not None and worst <= 1.0, "time")


def _memory(memory: dict[str, Any] | None) -> Target:
    what, target = "worker memory per request", "<= 10 KB"
    if memory is None:
        return Target(what, target, "not run", None, "count")
    per = float(memory["bytes_per_request"])
    measured = f"{per / 1024:.2f} KiB ({memory['streams']:,} streams)"
    return Target(what, target, measured, per <= 10 * 1024, "count")


def _shutdown(shutdown: dict[str, Any] | None) -> Target:
    """Within the grace plus twice bare trio cancelling as many parked tasks, same run."""
    what, target = "shutdown with 1,000 pending aborts", "<= grace + 2x bare trio"
    if shutdown is None:
        return Target(what, target, "not run", None, "time")
    over = float(shutdown["over_grace_ms"])
    floor = float(shutdown["trio_floor_ms"])
    multiple = f"{over / floor:.1f}x; " if floor > 0 else ""
    measured = (
        f"grace {1e3 * shutdown['grace_s']:.0f} ms + {over:.0f} ms; bare trio {ms(floor)} ms "
        f"({multiple}{shutdown['pending_cleanups']:,} pending, {shutdown['pending_tasks']:,} tasks)"
    )
    shaped = shutdown.get("trio_shaped_floor_ms")
    if shaped is not None:  # recorded runs before it had none
        shape = shutdown["worker_shape"]
        measured += (
            f"; trio alone at the worker's shape ({shape['frames']} frames, "
            f"{shape['cancel_scopes']} cancel scopes a task) {ms(float(shaped))} ms"
        )
    met = over <= 2 * floor and shutdown["pending_cleanups"] >= 1000
    return Target(what, target, measured, met, "time")


# -- the ratios against the baselines, from this run -----------------------------------

OURS = "trio-sglang"
#: The baselines, with the short names the ratio table's columns use.
BASELINES = {"first-response": "first-resp", "poll-then-abort": "poll-abort"}
RATIO_METRICS = {"abort_delay_ms": "abort delay p99", "stream_close_ms": "stream close p99"}
#: What each baseline is, in a sentence.
BASELINE_ABOUT = {
    "first-response": "the old Dynamo worker, which sends no abort before the first output",
    "poll-then-abort": "Dynamo 1.6's SGLang worker, which polls for dispatch, waits for it a "
    "bounded time, then aborts",
}


def legend(short: bool) -> str:
    """The baselines, by the names the table uses (short in the terminal's)."""
    return " ".join(
        f"{BASELINES[name]} = {name}, {about}." if short else f"{name}: {about}."
        for name, about in BASELINE_ABOUT.items()
    )


def _p99(cell: CellResult, metric: str) -> float | None:
    return percentiles(getattr(cell, metric))["p99"]


def ratios(cells: Sequence[CellResult]) -> list[dict[str, Any]]:
    """Per (phase, streams) where trio-sglang and a baseline both ran: p99s and baseline / ours.

    A p99 of ``None`` never stopped (infinite); a ratio of ``None`` has no
    finite value (a baseline that never stopped, or both 0).
    """
    by_cell = {(cell.phase, cell.concurrency, cell.approach): cell for cell in cells}
    found = []
    for (phase, size, approach), ours in by_cell.items():
        baselines = [name for name in BASELINES if (phase, size, name) in by_cell]
        if approach != OURS or not baselines:
            continue
        row: dict[str, Any] = {"phase": phase, "concurrency": size}
        for metric in RATIO_METRICS:
            mine = _p99(ours, metric)
            theirs = {name: _p99(by_cell[phase, size, name], metric) for name in baselines}
            row[metric] = {
                "p99": {OURS: mine, **theirs},
                "ratio": {name: ratio(value, mine) for name, value in theirs.items()},
            }
        found.append(row)
    return found


def _ratio_text(theirs: float | None, ours: float | None) -> str:
    if theirs is None:
        return "never"
    if ours is None:
        return "-"
    if ours <= 0:
        return "both 0" if theirs <= 0 else f"{ms(theirs)} ms"
    multiple = theirs / ours
    return f"{multiple:.1f}x" if multiple < 10 else f"{multiple:,.0f}x"


def headline_ratios(cells: Sequence[CellResult]) -> list[dict[str, Any]]:
    """Per phase, at the most streams the baselines ran; and the at-once burst."""
    rows = ratios(cells)
    spread = [row["concurrency"] for row in rows if not row["phase"].startswith("at_once")]
    top = max(spread, default=0)
    return [row for row in rows if row["concurrency"] == top or row["phase"].startswith("at_once")]


def _ratio_rows(
    rows: Sequence[dict[str, Any]], names: Sequence[str], size: int, *, compact: bool
) -> list[list[str]]:
    """The cells of the ratio table; ``compact``: streams in the phase column, if not ``size``."""
    out = []
    for row in rows:
        line = [row["phase"], f"{row['concurrency']:,}"][: 1 if compact else 2]
        if compact and row["concurrency"] != size:
            line[0] += f" x {row['concurrency']:,}"
        for metric in RATIO_METRICS:
            p99 = row[metric]["p99"]
            line.append(f"{ms(p99[OURS])} ms")
            line += [_ratio_text(p99[name], p99[OURS]) if name in p99 else "-" for name in names]
        out.append(line)
    return out


def _ratio_table(cells: Sequence[CellResult], *, markdown: bool = False) -> list[str]:
    rows = headline_ratios(cells)
    if not rows:
        return ["No baseline ran beside trio-sglang: no ratios."]
    names = [
        name for name in BASELINES if any(name in row["abort_delay_ms"]["p99"] for row in rows)
    ]
    size = rows[0]["concurrency"]
    body = _ratio_rows(rows, names, size, compact=not markdown)
    if markdown:
        header = ["phase", "streams"]
        for label in RATIO_METRICS.values():
            header += [f"{label}, {OURS}", *(f"{name} / {OURS}" for name in names)]
        return markdown_table(header, body)
    header = ["phase", *([OURS, *(BASELINES[name] for name in names)] * 2)]
    groups = [("", 1), *((label, 1 + len(names)) for label in RATIO_METRICS.values())]
    return table(header, body, groups=groups)


# -- the whole text --------------------------------------------------------------------


def _pair(samples: list[float]) -> str:
    stats = percentiles(samples)
    return f"{ms(stats['p50'])}/{ms(stats['p99'])}"


CELLS: list[Column[CellResult]] = [
    ("streams", lambda cell: f"{cell.concurrency:,}"),
    ("approach", lambda cell: cell.approach),
    ("cancels", lambda cell: f"{cell.cancels:,}"),
    ("close p50/p99", lambda cell: _pair(cell.stream_close_ms)),
    ("abort p50/p99", lambda cell: _pair(cell.abort_delay_ms)),
    ("lost", lambda cell: f"{cell.aborts_lost:,}"),
    ("leaked", lambda cell: f"{cell.leaked:,}"),
    ("wasted", lambda cell: count(percentiles(cell.wasted_tokens)["p99"])),
    ("cpu us", lambda cell: f"{cell.cpu_us_per_cancel:.0f}"),
    ("off", lambda cell: f"{cell.off_phase}"),
]


def _cells_table(cells: Sequence[CellResult]) -> list[str]:
    """The cells under a heading line per phase."""
    rows: list[CellResult | str] = []
    for phase in dict.fromkeys(cell.phase for cell in cells):
        rows += [f"{phase}:", *(cell for cell in cells if cell.phase == phase)]
    return columns_table(CELLS, rows, align="rlrrrrrrrr")


def _overhead_lines(report: Report) -> list[str]:
    cells = report.cells
    before, after = report.load_average
    texts = [
        f"machine: {report.cores} cores, load average {before:.2f} before, {after:.2f} after, "
        f"this process {report.cpu_s:.0f} s of CPU in {report.runtime_s:.0f} s; the OS "
        f"preempted it {sum(cell.preempted for cell in cells):,} times during the cells."
    ]
    if cells:
        texts.append(
            "worst of any cell while cancels were served (each cell's in results.json): "
            f"OS stall {max(cell.stall_max_ms for cell in cells):.1f} ms, "
            f"loop batch {max(cell.batch_max_ms for cell in cells):.1f} ms, "
            f"garbage collection {max(cell.gc_max_ms for cell in cells):.1f} ms"
        )
    if report.throughput is not None:
        t = report.throughput
        texts.append(
            f"throughput: worker {t['worker_tokens_per_s']:,.0f} tok/s, direct "
            f"{t['direct_tokens_per_s']:,.0f} tok/s, ratio {t['ratio']:.3f} ({t['method']}; "
            f"median per-round ratio {t['median_round_ratio']:.3f})"
        )
    if report.memory is not None:
        m = report.memory
        texts.append(
            f"memory: {m['bytes_per_request']:,.0f} bytes per in-flight request through the "
            f"worker ({m['streams']:,} streams, {m['method']})"
        )
    if report.shutdown is not None:
        s = report.shutdown
        texts.append(
            f"shutdown: {s['shutdown_ms']:.0f} ms with {s['pending_cleanups']:,} pending cleanups "
            f"(grace {1e3 * s['grace_s']:.0f} ms, {s['over_grace_ms']:.0f} ms over it, "
            f"{s['gc_ms']:.0f} ms of the whole in garbage collection); bare trio cancelling "
            f"{s['pending_tasks']:,} parked tasks right after: {ms(s['trio_floor_ms'])} ms "
            f"({s['trio_floor_gc_ms']:.0f} ms of it in garbage collection)"
        )
    return [line for text in texts for line in wrap(text)]


def summary_markdown(report: Report, machine: dict[str, Any], title: str) -> str:
    """``summary.md``: the ratios, the targets with verdicts, the machine and its load."""
    state = report.machine_state
    before, after = report.load_average
    lines = [
        f"# Cancel latency, {title}",
        "",
        f"- Run: `{report.config.get('size', 'custom')}` size, {report.runtime_s:.0f} s, "
        f"trio-sglang {machine.get('trio_sglang', '?')}, Python {machine.get('python', '?')}.",
        f"- Machine: {machine.get('platform', '?')}, {report.cores} cores, load average "
        f"{before:.2f} before and {after:.2f} after, this process {report.cpu_s:.0f} s of CPU.",
        f"- Verdicts: {state.line()}.",
        "",
        "## Against the baselines, in this run",
        "",
        f"{legend(short=False)} Each ratio is the baseline's p99 over trio-sglang's, both "
        "measured in this run; 'never': the baseline left requests running.",
        "",
        *_ratio_table(report.cells, markdown=True),
        "",
        "## Targets",
        "",
        *report.targets_markdown(),
    ]
    return "\n".join(lines) + "\n"

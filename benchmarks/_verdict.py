"""The targets, and when a run may judge them: honest verdicts on a busy machine.

Two kinds of target:

- **count-based** (aborts lost, requests leaked, tokens decoded after a cancel,
  bytes per request): another process on the machine cannot change a count,
  so these are judged on every run;
- **time-based** (a p99 in milliseconds, tokens per second, how long the
  at-once burst or the shutdown took): another process taking the CPU adds
  its time to ours, so these are judged only when the run had the machine to
  itself. Otherwise the verdict is ``not judged: machine busy (load X on N
  cores)``, never "met" or "MISSED".

The rule (``judge_machine``): a run was quiet when

1. the 1-minute load average before the run was at most ``QUIET_LOAD_PER_CORE``
   (0.5) runnable tasks per core;
2. the load average after the run, less this process's own share of it (its
   CPU seconds over the run's wall seconds: a single-threaded benchmark adds
   up to 1 to the load itself), was within the same bound;
3. no cell saw the OS hold the CPU away from the event loop for more than
   ``QUIET_STALL_MS`` (5 ms) in one batch while cancels were served (the
   'stall' figure each cell records: wall time minus this process's CPU time).

Comparisons with the baselines are not targets: they are ratios of two
numbers measured in the same run, on the same machine, with the same cancel
schedule (the ratio table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from _metrics import CellResult, percentiles

if TYPE_CHECKING:
    from _report import Report

__all__ = [
    "QUIET_LOAD_PER_CORE",
    "QUIET_STALL_MS",
    "MachineState",
    "Target",
    "fmt_ms",
    "judge_machine",
    "targets",
]

#: At most this many runnable tasks per core (1-minute load average, others' share).
QUIET_LOAD_PER_CORE = 0.5
#: At most this long a single OS stall of the event loop while cancels were served.
QUIET_STALL_MS = 5.0


@dataclass(frozen=True, slots=True)
class MachineState:
    """What the load figures and the stalls say about the run's machine."""

    quiet: bool
    #: Others' 1-minute load average: the larger of before and (after - ours).
    load: float
    cores: int
    worst_stall_ms: float

    @property
    def verdict(self) -> str:
        """What a time-based target says on this machine when it is not judged."""
        stall = (
            ""
            if self.worst_stall_ms <= QUIET_STALL_MS
            else f"; OS stall {self.worst_stall_ms:.1f} ms"
        )
        return f"not judged: machine busy (load {self.load:.2f} on {self.cores} cores{stall})"

    def line(self) -> str:
        limit = QUIET_LOAD_PER_CORE * self.cores
        if self.quiet:
            head = f"machine quiet (load {self.load:.2f} on {self.cores} cores)"
        else:
            head = self.verdict
        return (
            f"{head}; time targets are judged only when others' load stays <= {limit:g} "
            f"and no OS stall exceeds {QUIET_STALL_MS:g} ms (worst {self.worst_stall_ms:.1f} ms)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "quiet": self.quiet,
            "load": round(self.load, 2),
            "cores": self.cores,
            "worst_stall_ms": round(self.worst_stall_ms, 2),
            "rule": {
                "load_per_core_at_most": QUIET_LOAD_PER_CORE,
                "stall_ms_at_most": QUIET_STALL_MS,
            },
        }


def judge_machine(
    load_before: float, load_after: float, cores: int, own_load: float, worst_stall_ms: float
) -> MachineState:
    """The busy-machine rule (module docstring): a pure function of the figures."""
    cores = max(1, cores)
    others = max(load_before, load_after - max(0.0, own_load), 0.0)
    quiet = others <= QUIET_LOAD_PER_CORE * cores and worst_stall_ms <= QUIET_STALL_MS
    return MachineState(quiet, others, cores, worst_stall_ms)


# -- the targets ---------------------------------------------------------------------

Kind = Literal["count", "time"]


@dataclass(frozen=True, slots=True)
class Target:
    what: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run
    #: "count": judged on every run; "time": only on a quiet machine.
    kind: Kind = "count"
    #: Set for a time-based target on a busy machine (then ``met`` is None).
    not_judged: str = ""

    def judged_on(self, machine: MachineState) -> Target:
        if self.kind == "count" or self.met is None or machine.quiet:
            return self
        return Target(self.what, self.target, self.measured, None, self.kind, machine.verdict)

    @property
    def verdict(self) -> str:
        if self.not_judged:
            return self.not_judged
        return {True: "met", False: "MISSED", None: "not run"}[self.met]

    @property
    def label(self) -> str:
        return "not judged" if self.not_judged else self.verdict

    def line(self, keep: Callable[[str], str] = str) -> str:
        """One line; ``keep`` may mark the parts a wrap should not break."""
        label = f"[{self.label}]"
        return f"  {label:<12} {self.what}: {keep(self.measured)} {keep(f'(target {self.target})')}"

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "target": self.target,
            "measured": self.measured,
            "met": self.met,
            "verdict": self.verdict,
            "judged": "always" if self.kind == "count" else "on a quiet machine",
        }


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "never"
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


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
    measured = f"{fmt_ms(worst)} ms{where} (worst phase)"
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
    measured = f"worst p99 {_count(worst)}, max {_count(worst_max)}"
    return Target(what, target, measured, worst is not None and worst <= 1, "count")


def _throughput(throughput: dict[str, Any] | None) -> Target:
    what, target = "tokens/s through the worker / direct", ">= 0.9"
    if throughput is None:
        return Target(what, target, "not run", None, "time")
    ratio = float(throughput["ratio"])
    measured = f"{ratio:.3f} (median of rounds {throughput['median_round_ratio']:.3f})"
    return Target(what, target, measured, ratio >= 0.9, "time")


def _at_once(cells: Sequence[CellResult]) -> Target:
    what, target = "10,000 streams cancelled at once", "all stopped <= 500 ms"
    plain = [cell for cell in cells if cell.phase == "at_once"]  # not the tuned gc variant
    if not plain:
        return Target(what, target, "not run", None, "time")
    cell = plain[0]
    closed = percentiles(cell.stream_close_ms)["max"]
    stopped = percentiles(cell.abort_delay_ms)["max"]
    worst = None if closed is None or stopped is None else max(closed, stopped)
    measured = f"{cell.concurrency:,} stopped in {fmt_ms(worst)} ms"
    floor = cell.extra.get("trio_floor_ms")
    if floor and worst is not None:
        measured += f"; bare trio {fmt_ms(floor)} ms ({worst / floor:.1f}x)"
    met = worst is not None and worst <= 500 and cell.concurrency >= 10_000
    return Target(what, target, measured, met, "time")


def _close_at_scale(cells: Sequence[CellResult]) -> Target:
    """The sweep's largest cells (``--full``): the stream still closes within 1 ms."""
    what, target = "stream close p99 at 10,000 streams", "<= 1 ms"
    chosen = [cell for cell in _ours(cells) if cell.concurrency >= 10_000]
    if not chosen:
        return Target(what, target, "not run (--full runs it)", None, "time")
    worst = _worst(chosen, "stream_close_ms")
    measured = f"{fmt_ms(worst)} ms (worst phase)"
    return Target(what, target, measured, worst is not None and worst <= 1.0, "time")


def _memory(memory: dict[str, Any] | None) -> Target:
    what, target = "worker memory per request", "<= 10 KB"
    if memory is None:
        return Target(what, target, "not run", None, "count")
    per = float(memory["bytes_per_request"])
    measured = f"{per / 1024:.2f} KiB ({memory['streams']:,} streams)"
    return Target(what, target, measured, per <= 10 * 1024, "count")


def _shutdown(shutdown: dict[str, Any] | None) -> Target:
    what, target = "shutdown with 1,000 pending aborts", "<= grace + 50 ms"
    if shutdown is None:
        return Target(what, target, "not run", None, "time")
    over = float(shutdown["over_grace_ms"])
    measured = (
        f"grace {1e3 * shutdown['grace_s']:.0f} ms + {over:.0f} ms "
        f"({shutdown['pending_cleanups']:,} pending)"
    )
    met = over <= 50 and shutdown["pending_cleanups"] >= 1000
    return Target(what, target, measured, met, "time")

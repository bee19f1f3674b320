"""When a run may judge its targets: honest verdicts on a busy machine.

Every benchmark sets its own targets, as ``Target`` records; the rule that
decides which of them this machine may judge is one, here. Two kinds of
target:

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "QUIET_LOAD_PER_CORE",
    "QUIET_STALL_MS",
    "MachineState",
    "Target",
    "judge_machine",
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

    @property
    def head(self) -> str:
        """Quiet or busy, in a few words: ``machine quiet (load X on N cores)`` or ``verdict``."""
        if self.quiet:
            return f"machine quiet (load {self.load:.2f} on {self.cores} cores)"
        return self.verdict

    def line(self) -> str:
        limit = QUIET_LOAD_PER_CORE * self.cores
        return (
            f"{self.head}; time targets are judged only when others' load stays <= {limit:g} "
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

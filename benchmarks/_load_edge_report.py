"""What the edge scenario found: the normal clients with and without the hostile share.

Each of the two phases is judged as a load run of its own (``LoadReport``:
no 5xx, no failed request, nothing left at the engine, ...). On top: the
ratio of the normal clients' p99 ITL with the hostile share to without it,
a time target judged only on a quiet machine (``_verdict.judge_machine``);
what the hostile clients saw (how long the server held a non-reader's
request, what a trickler was answered); and the server's own count of the
clients it dropped, which must be exactly the non-readers it let go of: a
normal client dropped would show as one more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from _load_config import EdgeConfig
from _load_hostile import HostileTally
from _load_report import LoadReport, cores, mib, ms, pairs, zero
from _load_run import Run
from _metrics import percentiles
from _report import table, wrap
from _verdict import QUIET_LOAD_PER_CORE, MachineState, Target, judge_machine

__all__ = ["ITL_RATIO_TARGET", "EdgeReport"]

#: The normal clients' p99 ITL with the hostile share, over without it, at most.
ITL_RATIO_TARGET = 1.5


def _ratio(edge: float | None, baseline: float | None) -> float | None:
    return None if edge is None or not baseline else edge / baseline


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


@dataclass(slots=True)
class EdgeReport:
    run: Run
    edge: EdgeConfig
    hostile: HostileTally
    baseline: LoadReport = field(init=False)
    loaded: LoadReport = field(init=False)
    machine: MachineState = field(init=False)
    checks: list[Target] = field(init=False)

    def __post_init__(self) -> None:
        self.baseline, self.loaded = self.run.report(0), self.run.report(1)
        self.machine = self._machine()
        self.checks = [
            self.itl_target(),
            *(_phase("baseline", check) for check in self.baseline.phase_checks()),
            *(_phase("edge", check) for check in self.loaded.phase_checks()),
            *self._hostile_checks(),
            *self.loaded.process_checks(),
        ]

    @property
    def passed(self) -> bool:
        """Every count-based check held, and no judged time target was missed."""
        return all(check.met is not False for check in self.checks)

    def _machine(self) -> MachineState:
        """The busy-machine rule, with this process and the server as our own load.

        The rule's OS-stall part needs a per-cell stall figure this run does
        not measure; it is left at 0, so only the load average decides.
        """
        run = self.run
        server_cpu = self.loaded.after.get("process_cpu_seconds_total") or 0.0
        own = (run.cpu_s + server_cpu) / run.runtime_s
        before, after = run.load_average
        return judge_machine(before, after, os.cpu_count() or 1, own, 0.0)

    def _machine_line(self) -> str:
        machine = self.machine
        head = (
            f"machine quiet (load {machine.load:.2f} on {machine.cores} cores)"
            if machine.quiet
            else machine.verdict
        )
        return (
            f"{head}; the ITL target is judged only when others' load average stays <= "
            f"{QUIET_LOAD_PER_CORE * machine.cores:g} (the rule's OS-stall part is not "
            "measured in a load run)"
        )

    # -- derived figures ---------------------------------------------------------

    def _itl_p99(self) -> tuple[float | None, float | None]:
        """The normal clients' p99 ITL: baseline, edge."""
        return self.baseline.latency()["itl_s"]["p99"], self.loaded.latency()["itl_s"]["p99"]

    def itl_ratio(self) -> float | None:
        baseline, edge = self._itl_p99()
        return _ratio(edge, baseline)

    def itl_target(self) -> Target:
        ratio = self.itl_ratio()
        baseline, edge = self._itl_p99()
        measured = (
            "no tokens timed"
            if ratio is None
            else f"{ratio:.2f}x ({ms(edge)} against {ms(baseline)})"
        )
        met = None if ratio is None else ratio <= ITL_RATIO_TARGET
        what = "normal clients' p99 ITL with the hostile share over without"
        target = Target(what, f"<= {ITL_RATIO_TARGET:g}x", measured, met, "time")
        return target.judged_on(self.machine)

    def dropped(self) -> dict[str, int]:
        """Clients the server dropped during the edge phase, by reason."""
        return _dropped(self.loaded)

    def nonreaders(self) -> dict[str, Any]:
        hostile = self.hostile
        return {
            "count": self.edge.nonreaders,
            "requests": sum(hostile.let_go.values()),
            "let_go": dict(hostile.let_go),
            "held_s": percentiles(hostile.holds),
            "method": "from the request sent to the server letting go, as the client sees it "
            "without reading (SO_ERROR, or TCP_INFO's state on Linux), looked at every 50 ms",
        }

    def tricklers(self) -> dict[str, Any]:
        hostile = self.hostile
        return {
            "count": self.edge.tricklers,
            "requests": sum(hostile.trickles.values()),
            "answers": dict(hostile.trickles),
            "answered_s": percentiles(hostile.answers),
            "method": "from the headers sent to the first bytes of the answer (or the close)",
        }

    # -- the checks ------------------------------------------------------------------

    def _hostile_checks(self) -> list[Target]:
        hostile, edge = self.hostile, self.edge
        reset = hostile.let_go["reset"]
        dropped = self.dropped()
        by_bound = dropped.get("stalled", 0) + dropped.get("behind", 0)
        not_408 = sum(n for how, n in hostile.trickles.items() if how != "HTTP 408")
        checks = [
            zero(
                f"non-readers the server held past {edge.hold_bound:g} s",
                hostile.let_go["held past the bound"],
            ),
            Target(
                "clients dropped as stalled or behind: the non-readers the server reset",
                f"= {reset:,}",
                f"{by_bound:,} ({pairs(dropped.items())})",
                by_bound == reset,
            ),
            zero("tricklers answered otherwise than 408", not_408, pairs(hostile.trickles.items())),
            zero(
                "hostile connections that failed before being hostile",
                sum(hostile.failures.values()),
                pairs(hostile.failures.items()),
            ),
        ]
        if edge.nonreaders or edge.tricklers:
            checks.append(
                Target(
                    "the hostile share ran: non-readers let go, tricklers answered",
                    "> 0 each",
                    f"{len(hostile.holds):,} and {len(hostile.answers):,}",
                    (len(hostile.holds) > 0 or not edge.nonreaders)
                    and (len(hostile.answers) > 0 or not edge.tricklers),
                )
            )
        return checks

    # -- what a person reads ---------------------------------------------------------

    def format(self) -> str:
        c, edge = self.run.config, self.edge
        title = (
            f"Edge: {c.clients:,} normal clients for {c.duration:g} s, "
            f"{c.disconnect_fraction:.0%} of requests abandoned, {c.max_tokens} tokens each "
            f"(seed {c.seed}); first alone (baseline), then beside {edge.nonreaders:,} "
            f"non-readers and {edge.tricklers:,} tricklers (edge)"
        )
        lines = [
            *wrap(title),
            f"server: trio-sglang serve {' '.join([*c.serve_args(), *edge.serve_args()])}",
            "",
            *self._table(),
            "",
            *self._hostile_lines(),
            "",
            *wrap(f"runtime: {self.run.runtime_s:.1f} s; {self._machine_line()}", hang=2),
            "",
            "checks:",
            *(check.line() for check in self.checks),
            "",
            f"verdict: {'PASS' if self.passed else 'FAIL'}",
        ]
        if self.run.log_notable:
            lines[-1:-1] = ["server log, last notable lines:", *self.run.log_notable[-10:], ""]
        return "\n".join(lines)

    def _table(self) -> list[str]:
        """The normal clients and the server, one column per phase, and their ratio."""
        phases = (self.baseline, self.loaded)
        rows = [
            ["requests", *(f"{report.tally.count():,}" for report in phases), ""],
            ["completed / left / failed", *map(_outcomes, phases), ""],
            ["5xx", *(f"{report.tally.server_errors():,}" for report in phases), ""],
        ]
        for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
            for q in ("p50", "p99"):
                base, edge = (report.latency()[key][q] for report in phases)
                ratio = _ratio(edge, base)
                shown = "" if ratio is None else f"{ratio:.2f}x"
                rows.append([f"{name} {q}", ms(base), ms(edge), shown])
        rows += [
            ["RSS start / peak / end", *map(_rss, phases), ""],
            ["server CPU", *(cores(report.server()["cpu_cores"]) for report in phases), ""],
            ["live / lost / unconfirmed", *map(_leftovers, phases), ""],
            ["clients dropped", *(pairs(_dropped(report).items()) for report in phases), ""],
        ]
        return table(["normal clients", "baseline", "edge", "ratio"], rows)

    def _hostile_lines(self) -> list[str]:
        edge, readers, tricklers = self.edge, self.nonreaders(), self.tricklers()
        held, answered = readers["held_s"], tricklers["answered_s"]
        paragraphs = [
            f"non-readers ({edge.nonreaders:,}; n={edge.samples} x {edge.max_tokens:,} tokens, "
            f"SO_RCVBUF {edge.receive_buffer:,}, never read): {readers['requests']:,} requests; "
            f"the server let go by {pairs(self.hostile.let_go.items())}; held p50 "
            f"{_seconds(held['p50'])}, max {_seconds(held['max'])} (from the request sent)",
            f"tricklers ({edge.tricklers:,}; a byte every {edge.trickle_interval:g} s): "
            f"{tricklers['requests']:,} requests, answered {pairs(self.hostile.trickles.items())}; "
            f"p50 {_seconds(answered['p50'])}, max {_seconds(answered['max'])} after the headers",
            f"server, edge phase: clients dropped {pairs(self.dropped().items())}",
        ]
        return [line for paragraph in paragraphs for line in wrap(paragraph, hang=2)]

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks": [check.to_json() for check in self.checks],
            "itl_p99_ratio": self.itl_ratio(),
            "baseline": self.baseline.to_json(machine),
            "edge": self.loaded.to_json(machine),
            "hostile": {
                "non_readers": self.nonreaders(),
                "tricklers": self.tricklers(),
                "failures": dict(self.hostile.failures),
                "clients_dropped": self.dropped(),
            },
            "runtime_s": round(self.run.runtime_s, 1),
            "machine_state": self.machine.to_json(),
            "edge_config": self.edge.to_json(),
            "machine": machine,
        }


def _dropped(report: LoadReport) -> dict[str, int]:
    dropped: dict[str, int] = report.server()["clients_dropped"]
    return dropped


def _outcomes(report: LoadReport) -> str:
    tally = report.tally
    left = tally.count() - tally.count("completed") - tally.count("failed")
    return f"{tally.count('completed'):,} / {left:,} / {tally.count('failed'):,}"


def _rss(report: LoadReport) -> str:
    summary = {} if report.rss is None else report.rss.summary()
    start, peak, end = (mib(summary.get(key)) for key in ("start", "peak", "end"))
    return f"{start} / {peak} / {end}".replace(" MiB /", " /")


def _leftovers(report: LoadReport) -> str:
    server = report.server()
    keys = ("engine_live_requests", "aborts_lost", "cleanups_unconfirmed")
    return " / ".join(f"{server[key]:,}" for key in keys)


def _phase(label: str, check: Target) -> Target:
    return Target(f"{label}: {check.what}", check.target, check.measured, check.met, check.kind)

"""What the edge scenario found: the normal clients with and without the hostile share.

Each phase is judged as a load run of its own (``LoadReport``); the checks on top, and
why each: docs/benchmarks.md, "Hostile clients beside the load".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from _load_bad_peer import BadPeers
from _load_config import EdgeConfig
from _load_hostile import Holds, HostileTally
from _load_report import LoadReport, pairs, zero
from _load_run import Run
from _output import table, wrap
from _report_base import BenchReport
from _stats import percentiles
from _units import cores, mib, ms_of_s, ratio, seconds, times
from _verdict import QUIET_LOAD_PER_CORE, MachineState, Target, judge_machine

__all__ = ["ITL_RATIO_TARGET", "EdgeReport"]

#: The normal clients' p99 ITL with the hostile share, over without it, at most.
ITL_RATIO_TARGET = 1.5


@dataclass(slots=True)
class EdgeReport(BenchReport):
    run: Run
    edge: EdgeConfig
    hostile: HostileTally
    peers: BadPeers
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
            *self.peers.checks(),
            *self.loaded.process_checks(),
        ]

    def targets(self) -> list[Target]:
        return self.checks

    @property
    def passed(self) -> bool:
        """Every count-based check held, and no judged time target was missed."""
        return all(check.met is not False for check in self.checks)

    def _machine(self) -> MachineState:
        """The busy-machine rule, with this process and both servers as our own load.

        The rule's OS-stall part needs a per-cell stall figure this run does
        not measure; it is left at 0, so only the load average decides.
        """
        run = self.run
        server_cpu = self.loaded.after.get("process_cpu_seconds_total") or 0.0
        own = (run.cpu_s + server_cpu + self.peers.cpu_s()) / run.runtime_s
        before, after = run.load_average
        return judge_machine(before, after, os.cpu_count() or 1, own, 0.0)

    def _machine_line(self) -> str:
        machine = self.machine
        return (
            f"{machine.head}; the ITL target is judged only when others' load average stays <= "
            f"{QUIET_LOAD_PER_CORE * machine.cores:g} (the rule's OS-stall part is not "
            "measured in a load run)"
        )

    # -- derived figures ---------------------------------------------------------

    def _itl_p99(self) -> tuple[float | None, float | None]:
        """The normal clients' p99 ITL: baseline, edge."""
        return self.baseline.latency()["itl_s"]["p99"], self.loaded.latency()["itl_s"]["p99"]

    def itl_ratio(self) -> float | None:
        baseline, edge = self._itl_p99()
        return ratio(edge, baseline)

    def itl_target(self) -> Target:
        found = self.itl_ratio()
        baseline, edge = self._itl_p99()
        measured = (
            "no tokens timed"
            if found is None
            else f"{times(found)} ({ms_of_s(edge)} against {ms_of_s(baseline)})"
        )
        met = None if found is None else found <= ITL_RATIO_TARGET
        what = "normal clients' p99 ITL with the hostile share over without"
        target = Target(what, f"<= {ITL_RATIO_TARGET:g}x", measured, met, "time")
        return target.judged_on(self.machine)

    def dropped(self) -> dict[str, int]:
        """Clients the server dropped during the edge phase, by reason."""
        return _dropped(self.loaded)

    def zero_window_bound(self) -> float:
        """``EdgeConfig.zero_window_bound`` at the edge phase's p99 TTFT and ITL (the
        SimEngine's own timing where it timed none)."""
        config, latency = self.run.config, self.loaded.latency()
        first = latency["ttft_s"]["p99"] or config.first_token_delay
        token = latency["itl_s"]["p99"] or config.token_interval
        return self.edge.zero_window_bound(first, token)

    def _zero_window_late(self) -> int:
        """Zero-window connections the server held past ``zero_window_bound`` once it had
        answered (the wait to be taken under load is no slot held), or never let go of."""
        holds, bound = self.hostile.zero_window, self.zero_window_bound()
        late = sum(held > bound for held in holds.after_answer)
        return late + holds.let_go["held past the bound"]

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
        readers, zero_window = hostile.nonreaders, hostile.zero_window
        # Over HTTP/2 each stream of a zero-window connection reset alone counts as stalled,
        # but those still open when the connection itself is dropped (its client's small
        # receive buffer full) do not: a range, whose top a normal client dropped would pass.
        reset = readers.let_go["reset"]
        most = reset + zero_window.let_go["reset"] * edge.streams
        dropped = self.dropped()
        by_bound = dropped.get("stalled", 0) + dropped.get("behind", 0)
        not_408 = sum(n for how, n in hostile.trickles.items() if how != "HTTP 408")
        fanout_other = sum(
            n for how, n in hostile.fanout.items() if how not in ("HTTP 200", "HTTP 503")
        )
        descriptors = [
            report.after.get("process_open_fds") for report in (self.baseline, self.loaded)
        ]
        checks = [
            zero(
                f"non-readers the server held past {edge.hold_bound:g} s",
                readers.let_go["held past the bound"],
            ),
            zero(
                "zero-window connections the server held past "
                f"{self.zero_window_bound():.2f} s after answering (their answers made at "
                "the normal clients' p99 TTFT and ITL, its stall timeout, and 1 s)",
                self._zero_window_late(),
            ),
            Target(
                "clients dropped as stalled or behind: the non-readers the server reset, and "
                "up to each stream of the zero-window connections it reset",
                f"{reset:,} to {most:,}",
                f"{by_bound:,} ({pairs(dropped.items())})",
                reset <= by_bound <= most,
            ),
            zero(
                f"flooders the server held past {edge.hold_bound:g} s",
                hostile.flooders.let_go["held past the bound"],
            ),
            Target(
                "clients dropped as flooding: the flooders the server let go of",
                f"= {len(hostile.flooders.seconds):,}",
                f"{dropped.get('flooding', 0):,}",
                dropped.get("flooding", 0) == len(hostile.flooders.seconds),
            ),
            zero(
                "fan-out requests answered otherwise than 200 or 503",
                fanout_other,
                pairs(hostile.fanout.items()),
            ),
            Target(
                "server's open descriptors after the edge phase (settled), against the baseline's",
                "<= the baseline's",
                " against ".join("?" if n is None else f"{n:,.0f}" for n in descriptors),
                None
                if None in descriptors
                else float(descriptors[1] or 0) <= float(descriptors[0] or 0),
            ),
            zero("tricklers answered otherwise than 408", not_408, pairs(hostile.trickles.items())),
            zero(
                "hostile connections that failed before being hostile",
                sum(hostile.failures.values()),
                pairs(hostile.failures.items()),
            ),
        ]
        ran = {
            "non-readers let go": (edge.nonreaders, len(readers.seconds)),
            "tricklers answered": (edge.tricklers, len(hostile.answers)),
            "zero-window clients let go": (edge.zero_window, len(zero_window.seconds)),
            "flooders let go": (edge.flooders, len(hostile.flooders.seconds)),
            "pipelined requests": (edge.pipeliners, sum(hostile.pipelined.values())),
            "bursts reset": (edge.resetters, hostile.bursts),
            "fan-out requests answered": (edge.fanout, sum(hostile.fanout.values())),
        }
        if any(clients for clients, _ in ran.values()):
            checks.append(
                Target(
                    f"the hostile share ran: {', '.join(ran)}",
                    "> 0 each",
                    ", ".join(f"{seen:,}" for _, seen in ran.values()),
                    all(seen > 0 or not clients for clients, seen in ran.values()),
                )
            )
        return checks

    # -- what a person reads ---------------------------------------------------------

    def lines(self) -> list[str]:
        c, edge = self.run.config, self.edge
        title = (
            f"Edge: {c.clients:,} normal clients for {c.duration:g} s, "
            f"{c.disconnect_fraction:.0%} of requests abandoned, {c.max_tokens} tokens each "
            f"(seed {c.seed}); first alone (baseline), then beside {edge.nonreaders:,} "
            f"non-readers, {edge.tricklers:,} tricklers, {edge.zero_window:,} zero-window clients, "
            f"{edge.flooders:,} flooders, {edge.pipeliners:,} pipeliners, {edge.resetters:,} "
            f"resetters, {edge.fanout:,} fan-out clients and {edge.bad_peers:,} bad peers (edge)"
        )
        return [
            *wrap(title),
            f"server: trio-sglang serve {' '.join([*c.serve_args(), *edge.serve_args()])}",
            "",
            *self._table(),
            "",
            *self._hostile_lines(),
            "",
            *wrap(f"runtime: {self.run.runtime_s:.1f} s; {self._machine_line()}", hang=2),
            "",
            *self.verdict_lines("checks:", self.run.log_notable),
        ]

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
                shown = times(ratio(edge, base), none="")
                rows.append([f"{name} {q}", ms_of_s(base), ms_of_s(edge), shown])
        rows += [
            ["RSS start / peak / end", *map(_rss, phases), ""],
            ["server CPU", *(cores(report.server()["cpu_cores"]) for report in phases), ""],
            ["live / lost / unconfirmed", *map(_leftovers, phases), ""],
            ["clients dropped", *(pairs(_dropped(report).items()) for report in phases), ""],
        ]
        return table(["normal clients", "baseline", "edge", "ratio"], rows)

    def _hostile_lines(self) -> list[str]:
        edge, hostile, tricklers = self.edge, self.hostile, self.tricklers()
        answered = tricklers["answered_s"]
        paragraphs = [
            f"non-readers ({edge.nonreaders:,}; n={edge.samples} x {edge.max_tokens:,} tokens, "
            f"SO_RCVBUF {edge.receive_buffer:,}, never read): {_held(hostile.nonreaders)}",
            f"tricklers ({edge.tricklers:,}; a byte every {edge.trickle_interval:g} s): "
            f"{tricklers['requests']:,} requests, answered {pairs(hostile.trickles.items())}; "
            f"p50 {seconds(answered['p50'])}, max {seconds(answered['max'])} after the headers",
            f"zero-window clients ({edge.zero_window:,}; HTTP/2 prior knowledge, "
            f"SETTINGS_INITIAL_WINDOW_SIZE 0, {edge.streams} streaming /generate streams of "
            f"{edge.zero_window_tokens} tokens, no "
            f"WINDOW_UPDATE, never read; a connection every {edge.pace:g} s at most): "
            f"{_held(hostile.zero_window)}",
            f"flooders ({edge.flooders:,}; HTTP/2, 70 KB of PRIORITY frames for 999 idle "
            f"streams): {_held(hostile.flooders)}",
            f"pipeliners ({edge.pipeliners:,}; a /generate with a byte of a next request behind "
            f"it, then a reset; half streaming): {pairs(hostile.pipelined.items())}",
            f"resetters ({edge.resetters:,}): {hostile.bursts:,} bursts of {edge.burst_streams} "
            "streaming HTTP/2 requests, each reset 20 ms after it was sent",
            f"fan-out clients ({edge.fanout:,}; n={edge.fanout_children}, the server's bound "
            f"{edge.max_running_requests:,} engine requests): "
            f"answered {pairs(hostile.fanout.items())}",
            f"server, edge phase: clients dropped {pairs(self.dropped().items())}",
        ]
        lines = [line for paragraph in paragraphs for line in wrap(paragraph, hang=2)]
        return [*lines, *self.peers.lines()]

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "checks": self.targets_json(),
            "itl_p99_ratio": self.itl_ratio(),
            "baseline": self.baseline.to_json(machine),
            "edge": self.loaded.to_json(machine),
            "hostile": {
                "non_readers": _holds(self.edge.nonreaders, self.hostile.nonreaders),
                "tricklers": self.tricklers(),
                "zero_window": _holds(self.edge.zero_window, self.hostile.zero_window),
                "flooders": _holds(self.edge.flooders, self.hostile.flooders),
                "pipelined": dict(self.hostile.pipelined),
                "bursts_reset": self.hostile.bursts,
                "fanout": dict(self.hostile.fanout),
                "bad_peers": self.peers.to_json(),
                "failures": dict(self.hostile.failures),
                "clients_dropped": self.dropped(),
            },
            "runtime_s": round(self.run.runtime_s, 1),
            "machine_state": self.machine.to_json(),
            "edge_config": self.edge.to_json(),
            "machine": machine,
        }


def _holds(clients: int, holds: Holds) -> dict[str, Any]:
    return {
        "count": clients,
        "requests": holds.count(),
        "let_go": dict(holds.let_go),
        "answered": dict(holds.answers),
        "held_s": percentiles(holds.seconds),
        "held_after_answer_s": percentiles(holds.after_answer),
        "method": "from the request sent (held_s), or from the first bytes of the answer seen "
        "unread in the receive buffer (FIONREAD; held_after_answer_s), to the server letting "
        "go, as the client sees it without reading (SO_ERROR, or TCP_INFO's state on Linux), "
        "looked at every 50 ms; then what it had answered, read",
    }


def _held(holds: Holds) -> str:
    """How the server let go of connections that never read, and how long it held them."""
    held, after = percentiles(holds.seconds), percentiles(holds.after_answer)
    return (
        f"{holds.count():,} connections; the server let go by {pairs(holds.let_go.items())}, "
        f"having answered {pairs(holds.answers.items())}; held p50 {seconds(held['p50'])}, "
        f"max {seconds(held['max'])} from the request sent, p50 {seconds(after['p50'])}, max "
        f"{seconds(after['max'])} from its answer's first bytes"
    )


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
    return replace(check, what=f"{label}: {check.what}")

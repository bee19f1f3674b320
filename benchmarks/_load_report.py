"""What a load run found: the invariants it is judged by, the table a person reads, the JSON.

The server-side numbers are differences of two ``/metrics`` scrapes, one
after the warm-up (the server settled) and one after the run (settled
again), except the ones that must be zero for the server's whole life: lost
aborts, unconfirmed cleanups, requests the engine still holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from _load_clients import ENDPOINTS, LEFT, Outcome, Tally
from _load_config import Config
from _load_metrics import RssTrace, Scrape, bucket_delta, histogram_quantile
from _report_base import BenchReport
from _stats import Stats, percentiles
from _units import cores, mib, ms_of_s
from _verdict import Target

__all__ = ["LoadReport", "exit_check", "pairs", "zero"]

_ABORT_DELAY = "trio_sglang_abort_delay_seconds"
_QUANTILE_METHOD = (
    f"server histogram {_ABORT_DELAY} (from the worker seeing the client's stream end to "
    "the cleanup confirming the engine let go), difference of the scrapes before and after "
    "the run; quantiles by linear interpolation inside the bucket they fall in"
)


#: The table's columns: title, and the outcome it counts (None: every request).
_COLUMNS: tuple[tuple[str, Outcome | None], ...] = (
    ("requests", None),
    ("completed", "completed"),
    ("left, no response yet", "left_before_headers"),
    ("left before 1st token", "left_before_first_token"),
    ("left mid-stream", "left_mid_stream"),
    ("failed", "failed"),
)


@dataclass(slots=True)
class LoadReport(BenchReport):
    config: Config
    tally: Tally
    warmup: Tally
    before: Scrape
    after: Scrape
    #: Seconds the server took to settle after the run (None: not within the bound).
    settle_s: float | None
    #: The largest resident memory sampled during the run.
    #: Memory and CPU are None where the server exports no ``process_*`` metrics.
    peak_rss: float | None
    #: The server's exit status after SIGINT (None: still running at the bound).
    exit_status: int | None
    stop_s: float
    log_levels: dict[str, int]
    log_notable: list[str]
    #: The load phase alone, and the whole run (start-up to exit).
    load_s: float
    runtime_s: float
    client_cpu_s: float
    load_average: tuple[float, float]
    #: The server's memory every 0.5 s over the load and the settle (Linux).
    rss: RssTrace | None = None
    checks: list[Target] = field(init=False)

    def __post_init__(self) -> None:
        self.checks = [*self.phase_checks(), *self.process_checks()]

    def targets(self) -> list[Target]:
        return self.checks

    # -- derived figures ---------------------------------------------------------

    def _delta_by(self, name: str, label: str) -> dict[str, int]:
        before = self.before.by_label(name, label)
        after = self.after.by_label(name, label)
        return {key: round(value - before.get(key, 0.0)) for key, value in sorted(after.items())}

    def abort_delay(self) -> dict[str, Any]:
        buckets = bucket_delta(self.after.buckets(_ABORT_DELAY), self.before.buckets(_ABORT_DELAY))
        return {
            "cleanups": round(buckets[-1][1]),
            "p50_s": histogram_quantile(0.5, buckets),
            "p99_s": histogram_quantile(0.99, buckets),
            "buckets": {f"{bound:g}".replace("inf", "+Inf"): round(n) for bound, n in buckets},
            "method": _QUANTILE_METHOD,
        }

    def latency(self) -> dict[str, Stats]:
        """The users' TTFT and ITL (seconds, nearest rank): what a slow server costs them."""
        return {"ttft_s": percentiles(self.tally.ttft), "itl_s": percentiles(self.tally.itl)}

    def server(self) -> dict[str, Any]:
        rss = "process_resident_memory_bytes"
        cpu_before, cpu_after = (
            scrape.get("process_cpu_seconds_total") for scrape in (self.before, self.after)
        )
        sim = "trio_sglang_sim_events_total"
        return {
            "requests": self._delta_by("trio_sglang_requests_total", "outcome"),
            "cancellations": self._delta_by("trio_sglang_cancellations_total", "phase"),
            "clients_dropped": self._delta_by("trio_sglang_clients_dropped_total", "reason"),
            "engine_events": self._delta_by(sim, "kind"),
            "engine_live_requests": round(self.after.value("trio_sglang_engine_live_requests")),
            "aborts_lost": round(self.after.value(sim, kind="abort_lost")),
            "cleanups_unconfirmed": round(
                self.after.value("trio_sglang_cleanups_unconfirmed_total")
            ),
            "rss_bytes": {
                "before": self.before.get(rss),
                "after": self.after.get(rss),
                "peak": self.peak_rss,
                **({} if self.rss is None else {"trace": self.rss.to_json()}),
            },
            "cpu_cores": None
            if cpu_before is None or cpu_after is None
            else (cpu_after - cpu_before) / self.load_s,
            "settle_s": self.settle_s,
            "exit_status": self.exit_status,
            "stop_s": self.stop_s,
            "log_levels": self.log_levels,
            "log_notable": self.log_notable,
        }

    # -- the invariants --------------------------------------------------------------

    def phase_checks(self) -> list[Target]:
        """The invariants of the load between the two scrapes: what the users and the
        server's counters saw."""
        tally, server = self.tally, self.server()
        completed = tally.count("completed")
        left = sum(tally.count(outcome) for outcome in LEFT)
        checks = [
            zero("responses 5xx (status, or an error event in the stream)", tally.server_errors()),
            zero("requests failed", tally.count("failed"), pairs(tally.failures.items())),
            zero("requests the engine still holds at the end", server["engine_live_requests"]),
            zero("aborts lost at the engine", server["aborts_lost"]),
            zero(
                "cleanups unconfirmed (ended with the engine holding the request)",
                server["cleanups_unconfirmed"],
            ),
            Target(
                "server settled after the run (no open stream, no cleanup in flight)",
                f"within {self.config.settle_timeout:g} s",
                "no" if self.settle_s is None else f"in {self.settle_s:.2f} s",
                self.settle_s is not None,
            ),
        ]
        if self.config.disconnect_fraction > 0:
            checks.append(
                Target(
                    "the load did both: requests completed and requests left",
                    "> 0 and > 0",
                    f"{completed:,} and {left:,}",
                    completed > 0 and left > 0,
                )
            )
        return checks

    def process_checks(self) -> list[Target]:
        """The invariants of the server process's whole life: its log, its exit."""
        errors = self.log_levels.get("ERROR", 0) + self.log_levels.get("CRITICAL", 0)
        return [
            zero("ERROR lines in the server's log", errors),
            exit_check("server", self.exit_status, self.stop_s, self.config.stop_timeout),
        ]

    # -- what a person reads ---------------------------------------------------------

    def lines(self) -> list[str]:
        c, tally, server = self.config, self.tally, self.server()
        delay, latency = self.abort_delay(), self.latency()
        rss = server["rss_bytes"]
        lines = [
            f"Load over loopback: {c.clients:,} clients for {c.duration:g} s, "
            f"{c.disconnect_fraction:.0%} of requests abandoned, {c.max_tokens} tokens each "
            f"(seed {c.seed})",
            f"server: trio-sglang serve {' '.join(c.serve_args())}",
            "",
            f"{'endpoint':<22}" + "".join(f"{title:>{len(title) + 3}}" for title, _ in _COLUMNS),
        ]
        for endpoint in (*ENDPOINTS, None):
            counts = (
                f"{tally.count(outcome, endpoint):>{len(title) + 3},}"
                for title, outcome in _COLUMNS
            )
            lines.append(f"{endpoint or 'all':<22}" + "".join(counts))
        statuses = ", ".join(f"{code} x {n:,}" for code, n in sorted(tally.statuses.items()))
        engine = server["engine_events"]
        lines += [
            "",
            f"statuses: {statuses or 'none'}; tokens received {tally.tokens:,} (the engine "
            f"decoded {engine.get('token', 0):,}, aborted {engine.get('abort_applied', 0):,} "
            f"requests and released {engine.get('released', 0):,} before dispatch)",
            f"server: requests {pairs(server['requests'].items())}; "
            f"client gone {pairs(server['cancellations'].items())}; clients dropped "
            f"{pairs(server['clients_dropped'].items())}",
            f"server memory: RSS {mib(rss['before'])} before, {mib(rss['after'])} after, "
            f"{mib(rss['peak'])} at the largest sample during the run",
            f"CPU during the load: server {cores(server['cpu_cores'])}, clients "
            f"{cores(self.client_cpu_s / self.load_s)}; machine load average "
            f"{self.load_average[0]:.2f} before, {self.load_average[1]:.2f} after",
            f"disconnect-to-abort over {delay['cleanups']:,} cleanups: p50 "
            f"{ms_of_s(delay['p50_s'])}, p99 {ms_of_s(delay['p99_s'])} (the server's histogram, "
            "interpolated inside buckets)",
            f"at the clients: TTFT p50 {ms_of_s(latency['ttft_s']['p50'])}, p99 "
            f"{ms_of_s(latency['ttft_s']['p99'])}; ITL p50 {ms_of_s(latency['itl_s']['p50'])}, "
            f"p99 {ms_of_s(latency['itl_s']['p99'])} (the engine's token interval: "
            f"{ms_of_s(c.token_interval)})",
            f"runtime: {self.runtime_s:.1f} s (load {self.load_s:.1f} s)",
            "",
            *self.verdict_lines("invariants:", self.log_notable),
        ]
        return lines

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        tally = self.tally
        return {
            "passed": self.passed,
            "checks": self.targets_json(),
            "clients": {
                "requests": tally.count(),
                "outcomes": {
                    endpoint: {
                        outcome: n
                        for (where, outcome), n in tally.outcomes.items()
                        if where == endpoint
                    }
                    for endpoint in ENDPOINTS
                },
                "failures": dict(tally.failures),
                "statuses": {str(code): n for code, n in sorted(tally.statuses.items())},
                "stream_errors": dict(sorted(tally.stream_errors.items())),
                "tokens": tally.tokens,
                **self.latency(),
                "cpu_cores": self.client_cpu_s / self.load_s,
                "warmup_requests": self.warmup.count(),
            },
            "server": self.server(),
            "disconnect_to_abort": self.abort_delay(),
            "load_s": round(self.load_s, 2),
            "runtime_s": round(self.runtime_s, 1),
            "load_average": {"before": self.load_average[0], "after": self.load_average[1]},
            "config": self.config.to_json(),
            "machine": machine,
        }


def exit_check(server: str, status: int | None, stop_s: float, bound: float) -> Target:
    """A server's exit after SIGINT: status 0 within ``bound`` s (None: still running)."""
    return Target(
        f"{server} exits 0 on SIGINT",
        f"within {bound:g} s",
        f"status {status} in {stop_s:.2f} s"
        if status is not None
        else f"still running after {bound:g} s",
        status == 0,
    )


def zero(what: str, count: int, detail: str = "") -> Target:
    measured = f"{count:,} ({detail})" if count and detail else f"{count:,}"
    return Target(what, "0", measured, count == 0)


def pairs(items: Iterable[tuple[str, int]]) -> str:
    return ", ".join(f"{key} {value:,}" for key, value in items) or "none"

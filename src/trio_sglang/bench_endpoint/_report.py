"""A run's results: what they hold, the JSON they are saved as, and the tables people read.

Times in the tables are milliseconds; percentiles are by nearest rank, so
every one is a latency some client really had. "-" means nothing to show
(no client of that kind); "n/m" means not measured on this server, and the
notes below the table say why.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "PhaseResult",
    "Report",
    "compare_table",
    "load",
    "percentile",
    "table",
]

FORMAT_VERSION = 1


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest rank: the smallest value with at least ``p`` of them at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


@dataclass(slots=True)
class PhaseResult:
    name: str
    requests: int
    left: int
    completed: int
    failed: int
    #: Why requests failed, with how many did so.
    errors: dict[str, int]
    #: Per client that left and whose release the gauges showed before any probe:
    #: ms from its leave to that.
    release_ms: list[float]
    #: The p99, over the phase's samples, of the time from one scrape's start to the
    #: next one's answer: a release is known only to within this.
    resolution_ms: float | None
    #: Requests the gauges never showed (see ``_deconvolve``).
    unseen: int
    #: Releases that showed only once a probe request made the engine step.
    stale: int
    #: Requests still held after the settle and the probe: never released.
    leaked: int
    #: ``before_first_token`` clients whose first token came before the delay.
    early: int
    tokens_received: int
    #: The counter's rise over the phase; None where there is no counter.
    tokens_generated: float | None
    #: Generated minus received: tokens made for nobody; None where not measured.
    wasted_tokens: float | None
    ttft_ms: list[float]
    itl_ms: list[float]
    #: Seconds from the run's start: the phase's span and each client's leave.
    window: tuple[float, float]
    leaves: list[float]
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Report:
    started: str
    url: str
    api: str
    model: str | None
    metrics_urls: list[str]
    server: str
    in_flight: list[str]
    tokens: str | None
    #: Whose requests the gauges count: engine, frontend, unknown.
    holds: str
    #: The counter may miss tokens made for clients that left (SGLang, vLLM).
    tokens_lower_bound: bool
    concurrency: int
    requests: int
    max_tokens: int
    leave_delay_ms: float
    mid_stream_chunks: int
    settle_s: float
    #: Achieved, not asked for: the median time between two samples, and one scrape's.
    sample_every_ms: float
    scrape_ms: float
    scrape_failures: int
    #: What this server's metrics cannot show, and why (from its kind).
    limits: list[str]
    #: What this run could not measure (a missing counter, ...).
    not_measured: list[str]
    phases: list[PhaseResult]
    #: Tokens per second the counter rose by once every client had gone (None: no counter).
    idle_tokens_per_s: float | None
    #: Requests in flight at the end beyond those at the start.
    held_at_end: int
    #: The samples, seconds from the run's start: t, in flight, tokens.
    timeline: dict[str, list[float | None]]
    version: int = FORMAT_VERSION

    def save(self, path: Path) -> None:
        """As strict JSON: a figure that is not finite (a server's ``+Inf`` counter) is null."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_finite(asdict(self)), indent=1, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, an infinity) made ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def load(path: Path) -> Report:
    """A report saved by ``Report.save``; ``ValueError`` if it is not one this version reads."""
    data: dict[str, Any] = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a bench-endpoint report (format {FORMAT_VERSION})")
    phases = [
        PhaseResult(**{**phase, "window": tuple(phase["window"])}) for phase in data["phases"]
    ]
    return Report(**{**data, "phases": phases})


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _count(value: float | None, *, bound: bool = False) -> str:
    if value is None:
        return "n/m"
    return f"{'>=' if bound else ''}{value:,.0f}"


_HOLDS = {
    "engine": "the engine's requests",
    "frontend": "the frontend's HTTP handlers",
    "unknown": "as named with --metrics",
}


def _header(report: Report) -> list[str]:
    tokens = report.tokens or "none"
    return [
        f"bench-endpoint {report.url} ({report.api}"
        + (f", model {report.model}" if report.model else "")
        + f"), server {report.server}: {report.concurrency} at once, "
        f"{report.requests} requests per phase, {report.max_tokens} tokens each",
        f"in flight = {' + '.join(report.in_flight)} ({_HOLDS.get(report.holds, report.holds)}); "
        f"generated tokens = {tokens}; from {', '.join(report.metrics_urls)}",
        f"resolution: a sample every {report.sample_every_ms:.1f} ms (median), one scrape "
        f"{report.scrape_ms:.1f} ms ({report.scrape_failures} failed); +-res: the phase's p99 "
        "from one scrape's start to the next one's answer, what a release time is good to",
    ]


def table(report: Report) -> str:
    """The report as people read it: the leaving phases, then the control, then the notes."""
    lower_bound = report.tokens_lower_bound
    head = (
        f"{'phase':<25}{'left':>5}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}{'+-res':>7}"
        f"{'unseen':>8}{'stale':>7}{'leaked':>8}{'tokens after':>14}{'per left':>10}"
    )
    lines = [*_header(report), "", f"{'':<33}release after the client left, ms", head]
    lines.append("-" * len(head))
    control = [phase for phase in report.phases if phase.name == "stay"]
    for phase in report.phases:
        if phase.name == "stay":
            continue
        release = phase.release_ms
        per_left = (
            None
            if phase.wasted_tokens is None or not phase.left
            else phase.wasted_tokens / phase.left
        )
        lines.append(
            f"{phase.name:<25}{phase.left:>5}"
            + "".join(f"{_ms(percentile(release, p)):>8}" for p in (0.5, 0.9, 0.99, 1.0))
            + f"{_ms(phase.resolution_ms):>7}{phase.unseen:>8}{phase.stale:>7}{phase.leaked:>8}"
            + f"{_count(phase.wasted_tokens, bound=lower_bound):>14}"
            + (f"{per_left:>10.2f}" if per_left is not None else f"{'n/m':>10}")
        )
    for phase in control:
        lines += ["", _control_line(phase)]
    if report.idle_tokens_per_s is not None:
        lines.append(
            f"after every client had gone: {report.idle_tokens_per_s:,.1f} tokens/s generated, "
            f"{report.held_at_end} request(s) still held"
        )
    else:
        lines.append(f"after every client had gone: {report.held_at_end} request(s) still held")
    notes = [
        note for phase in report.phases for note in (f"{phase.name}: {n}" for n in phase.notes)
    ]
    for title, items in (
        ("not measured in this run", report.not_measured),
        ("what this server's metrics cannot show", report.limits),
        ("notes", notes),
    ):
        if items:
            lines += ["", f"{title}:", *(f"- {item}" for item in items)]
    return "\n".join(lines)


def _control_line(phase: PhaseResult) -> str:
    ttft = " ".join(f"p{round(p * 100)} {_ms(percentile(phase.ttft_ms, p))}" for p in (0.5, 0.99))
    itl = " ".join(f"p{round(p * 100)} {_ms(percentile(phase.itl_ms, p))}" for p in (0.5, 0.99))
    generated = _count(phase.tokens_generated)
    return (
        f"stay (the control, {phase.completed} of {phase.requests} completed): TTFT ms {ttft}; "
        f"ITL ms {itl}; tokens generated {generated}, received {phase.tokens_received:,}"
    )


def compare_table(reports: Sequence[tuple[str, Report]]) -> str:
    """Runs side by side, a row per phase: release p50/p99 (ms), leaked, tokens after per left."""
    names = [phase.name for _, report in reports for phase in report.phases]
    width = 34
    lines = [f"{'phase':<25}" + "".join(f"{label[: width - 2]:>{width}}" for label, _ in reports)]
    lines.append(f"{'':<25}" + f"{'p50 / p99 ms, leaked, tok/left':>{width}}" * len(reports))
    lines.append("-" * len(lines[0]))
    for name in dict.fromkeys(names):
        cells = []
        for _, report in reports:
            phase = next((p for p in report.phases if p.name == name), None)
            cells.append(_compare_cell(phase))
        lines.append(f"{name:<25}" + "".join(f"{cell:>{width}}" for cell in cells))
    for label, report in reports:
        lines.append(f"{label}: {report.url}, server {report.server}, {report.started}")
    return "\n".join(lines)


def _compare_cell(phase: PhaseResult | None) -> str:
    if phase is None:
        return "-"
    if phase.name == "stay":
        ttft, itl = (_ms(percentile(values, 0.5)) for values in (phase.ttft_ms, phase.itl_ms))
        return f"TTFT p50 {ttft}, ITL p50 {itl}"
    wasted = (
        "n/m"
        if phase.wasted_tokens is None or not phase.left
        else f"{phase.wasted_tokens / phase.left:.2f}"
    )
    p50, p99 = (_ms(percentile(phase.release_ms, p)) for p in (0.5, 0.99))
    return f"{p50} / {p99}, {phase.leaked}, {wasted}"

"""A whole run: find out which server it is, warm it up, then every phase in waves.

A phase sends its requests in waves of ``concurrency`` clients that start
together. After a wave, the run waits (up to ``settle`` seconds) for the
in-flight gauge to come back to where it was before the wave. If it does
not, one short probe request is read to its end, which makes an idle
engine take a step and refresh gauges that only change then; whatever is
still above the baseline after that is leaked. Only then does the next wave
start, so each wave's drops belong to that wave (``_deconvolve``).

The gauges are sampled all along by one ``Sampler`` task; the clients of a
wave are tasks of one nursery; every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import trio

from ._deconvolve import attribute_releases
from ._departures import Phase
from ._prometheus import parse_series
from ._report import PhaseResult, Report, percentile
from ._sampler import Sample, Sampler, ScrapeFailed, scrape
from ._servers import ServerKind, detect_kind
from ._visits import LeaveRule, Target, Visit, discover_model, visit

__all__ = ["Plan", "Refused", "run_bench"]

#: The probe: one request of this many tokens, read to its end.
_PROBE_TOKENS = 1
#: The warm-up's requests: enough tokens for a TTFT, no more.
_WARM_UP_TOKENS = 2
#: The idle window at the end, over which the token counter must stand still.
_IDLE_WINDOW = 1.0


class Refused(Exception):
    """The run cannot start or go on, for the reason given (one line)."""


@dataclass(frozen=True, slots=True)
class Plan:
    target: Target
    metrics_urls: tuple[str, ...]
    #: None: recognise it from the metrics page.
    kind: ServerKind | None
    phases: tuple[Phase, ...]
    concurrency: int
    requests: int
    #: None: half the warm-up's median TTFT.
    leave_delay: float | None
    mid_stream_chunks: int
    sample_interval: float
    settle: float


@dataclass(slots=True)
class _Run:
    """What every phase shares."""

    plan: Plan
    kind: ServerKind
    target: Target
    sampler: Sampler
    rule: LeaveRule
    started: float
    #: The same moment in UTC, for the report.
    started_utc: str
    progress: Callable[[str], None]
    requests_sent: int = 0

    def next_index(self) -> int:
        self.requests_sent += 1
        return self.requests_sent


async def run_bench(plan: Plan, progress: Callable[[str], None]) -> Report:
    """The run, start to end; ``Refused`` when the server cannot be measured at all."""
    kind, with_tokens, not_measured = await _identify(plan)
    target = plan.target
    if target.model is None and target.api != "sglang-generate":
        try:
            target = dataclasses.replace(target, model=await discover_model(target))
        except (httpx.HTTPError, LookupError, ValueError, KeyError) as exc:
            raise Refused(f"cannot find the model at {target.url}/v1/models: {exc}") from exc
    sampler = Sampler(
        plan.metrics_urls,
        kind,
        interval=plan.sample_interval,
        timeout=max(1.0, plan.settle),
        headers=target.headers,
        with_tokens=with_tokens,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sampler.run)
        if not sampler.samples:  # its first scrape failed
            raise Refused(
                f"cannot read the metrics at {', '.join(plan.metrics_urls)}: {sampler.last_failure}"
            )
        started = trio.current_time()
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        initial = sampler.latest()
        rule = await _warm_up(plan, target, sampler, progress)
        run = _Run(plan, kind, target, sampler, rule, started, started_utc, progress)
        phases = []
        for number, phase in enumerate(plan.phases, start=1):
            phases.append(await _run_phase(run, phase, f"[{number}/{len(plan.phases)}]"))
        idle_rate = await _idle_rate(sampler)
        nursery.cancel_scope.cancel()
    return _report(run, not_measured, phases, initial, idle_rate)


async def _identify(plan: Plan) -> tuple[ServerKind, bool, list[str]]:
    """The server's kind (given or recognised), whether its token counter is there, and
    what is not measured because it is not."""
    pages = []
    async with httpx.AsyncClient(
        timeout=10, headers=plan.target.headers, trust_env=False
    ) as client:
        for url in plan.metrics_urls:
            try:
                pages.append(await scrape(client, url, within=10))
            except ScrapeFailed as exc:
                hint = (
                    " (SGLang serves them only with --enable-metrics)" if exc.status == 404 else ""
                )
                raise Refused(f"cannot read the metrics at {exc}{hint}") from exc
    kind = plan.kind
    for url, page in zip(plan.metrics_urls, pages, strict=True):
        found = detect_kind(page)
        if kind is None:
            kind = found
        if kind is None:
            raise Refused(
                f"{url} has no in-flight gauge of a known server (trio-sglang serve, SGLang, "
                "vLLM, Dynamo's frontend): name them with --metrics in_flight=NAME[+NAME...]"
            )
        missing = [s for s, value in parse_series(page, kind.in_flight).items() if value is None]
        if len(missing) == len(kind.in_flight):
            raise Refused(f"{url} has none of {', '.join(map(str, kind.in_flight))}")
    assert kind is not None
    not_measured = []
    with_tokens = kind.tokens is not None
    for url, page in zip(plan.metrics_urls, pages, strict=True):
        if kind.tokens is not None and parse_series(page, [kind.tokens])[kind.tokens] is None:
            with_tokens = False
            not_measured.append(
                f"tokens after leaving: {kind.tokens} is not on {url}{kind.tokens_hint}"
            )
    return kind, with_tokens, not_measured


async def _warm_up(
    plan: Plan, target: Target, sampler: Sampler, progress: Callable[[str], None]
) -> LeaveRule:
    """One wave of short requests read to the end: the server is warm, the route works,
    and their median TTFT sets the ``before_first_token`` delay unless one was given."""
    progress(f"warm-up: {plan.concurrency} requests")
    baseline = sampler.latest().in_flight
    visits = [Visit("warm-up") for _ in range(plan.concurrency)]
    async with trio.open_nursery() as nursery:
        for index, record in enumerate(visits):
            nursery.start_soon(
                visit, target, Phase("stay"), LeaveRule(0.0, 0), record, -1 - index, _WARM_UP_TOKENS
            )
    ttfts = [ttft for record in visits if (ttft := record.ttft) is not None]
    if not ttfts:
        errors = Counter(record.error for record in visits)
        raise Refused(f"no warm-up request got a token: {errors.most_common(1)[0][0]}")
    with trio.move_on_after(plan.settle):
        await sampler.wait_for(lambda sample: sample.in_flight < baseline + 0.5)
    delay = plan.leave_delay if plan.leave_delay is not None else statistics.median(ttfts) / 2
    return LeaveRule(delay, plan.mid_stream_chunks)


@dataclass(slots=True)
class _Wave:
    visits: list[Visit]
    baseline: Sample
    end: Sample
    samples: list[Sample]
    probe: Visit | None
    probed_at: float | None


async def _run_phase(run: _Run, phase: Phase, label: str) -> PhaseResult:
    plan = run.plan
    waves: list[_Wave] = []
    window_start = trio.current_time()
    sizes = [
        min(plan.concurrency, plan.requests - done)
        for done in range(0, plan.requests, plan.concurrency)
    ]
    for number, size in enumerate(sizes, start=1):
        run.progress(f"{label} {phase.name}: wave {number}/{len(sizes)}")
        waves.append(await _wave(run, phase, size))
    return _phase_result(run, phase, waves, (window_start, trio.current_time()))


async def _wave(run: _Run, phase: Phase, size: int) -> _Wave:
    sampler, settle = run.sampler, run.plan.settle
    baseline = sampler.latest()
    started = trio.current_time()
    visits = [Visit(phase.name) for _ in range(size)]
    async with trio.open_nursery() as nursery:
        for record in visits:
            nursery.start_soon(visit, run.target, phase, run.rule, record, run.next_index())
    last_end = max(record.ended_at for record in visits)
    limit = baseline.in_flight + 0.5

    def back(after: float) -> Callable[[Sample], bool]:
        return lambda sample: sample.sent >= after and sample.in_flight < limit

    probe, probed_at = None, None
    with trio.move_on_after(settle) as waiting:
        await sampler.wait_for(back(last_end))
    if waiting.cancelled_caught and run.kind.stale_when_idle:
        probed_at = trio.current_time()
        probe = Visit("probe")
        await visit(run.target, Phase("stay"), run.rule, probe, run.next_index(), _PROBE_TOKENS)
        with trio.move_on_after(settle):
            await sampler.wait_for(back(probe.ended_at))
    samples = [sample for sample in sampler.samples if sample.sent >= started]
    return _Wave(visits, baseline, sampler.latest(), samples, probe, probed_at)


def _phase_result(
    run: _Run, phase: Phase, waves: Sequence[_Wave], window: tuple[float, float]
) -> PhaseResult:
    release_ms: list[float] = []
    unseen = stale = leaked = 0
    generated: float | None = 0.0
    received = 0
    for wave in waves:
        ended = sorted(
            (record for record in wave.visits if record.outcome != "failed"),
            key=lambda record: record.ended_at,
        )
        releases = attribute_releases(
            [record.ended_at for record in ended], wave.baseline.in_flight, wave.samples
        )
        if phase.leave != "stay":
            unseen += releases.unseen
        for record, released in zip(ended, releases.released_at, strict=True):
            if released is None:
                leaked += 1
            elif record.outcome != "left":
                continue
            elif wave.probed_at is not None and released >= wave.probed_at:
                stale += 1
            else:
                release_ms.append((released - record.ended_at) * 1000)
        received += sum(record.tokens for record in wave.visits)
        received += wave.probe.tokens if wave.probe else 0
        if (
            generated is not None
            and wave.end.tokens is not None
            and wave.baseline.tokens is not None
        ):
            generated += wave.end.tokens - wave.baseline.tokens
        else:
            generated = None
    visits = [record for wave in waves for record in wave.visits]
    outcomes = Counter(record.outcome for record in visits)
    spans = [  # from the sample before each wave on, so that a short wave has one too
        (later.received - earlier.sent) * 1000
        for wave in waves
        for earlier, later in itertools.pairwise([wave.baseline, *wave.samples])
    ]
    early = sum(1 for r in visits if phase.leave == "before_first_token" and r.token_times)
    errors = Counter(r.error for r in visits if r.error is not None)
    notes = _notes(unseen, stale, leaked, early, generated, received, run.rule, errors)
    wasted = None if generated is None or generated < received else generated - received
    return PhaseResult(
        name=phase.name,
        requests=len(visits),
        left=outcomes["left"],
        completed=outcomes["completed"],
        failed=outcomes["failed"],
        errors=dict(errors),
        release_ms=release_ms,
        resolution_ms=percentile(spans, 0.99),
        unseen=unseen,
        stale=stale,
        leaked=leaked,
        early=early,
        tokens_received=received,
        tokens_generated=generated,
        wasted_tokens=wasted if phase.leave != "stay" else None,
        ttft_ms=[ttft * 1000 for r in visits if (ttft := r.ttft) is not None],
        itl_ms=[gap * 1000 for r in visits for gap in r.itl()],
        window=(window[0] - run.started, window[1] - run.started),
        leaves=[r.ended_at - run.started for r in visits if r.outcome == "left"],
        notes=notes,
    )


def _notes(
    unseen: int,
    stale: int,
    leaked: int,
    early: int,
    generated: float | None,
    received: int,
    rule: LeaveRule,
    errors: Counter[str],
) -> list[str]:
    notes = []
    if errors:
        (error, count), *_ = errors.most_common(1)
        notes.append(f"{errors.total()} request(s) failed; {count} of them: {error}")
    if unseen:
        notes.append(
            f"{unseen} request(s) never showed in the gauges at once with the others (gone "
            "before the server counted them, or within one sample): their release is the "
            "first sample after they left"
        )
    if stale:
        notes.append(
            f"{stale} release(s) showed only after a probe request: the gauges had kept a "
            "stale value, so these are left out of the percentiles"
        )
    if leaked:
        notes.append(
            f"{leaked} request(s) never let go: still held after --settle (and, where the "
            "gauges can be stale, after a probe)"
        )
    if early:
        notes.append(
            f"{early} client(s) had a token before --leave-delay ({rule.delay * 1000:.0f} ms) "
            "and left at it instead"
        )
    if generated is not None and generated < received:
        notes.append(
            f"the token counter rose by {generated:,.0f} while the clients received "
            f"{received:,}: it misses tokens, so tokens after leaving are not measured"
        )
    return notes


async def _idle_rate(sampler: Sampler) -> float | None:
    """Tokens per second generated once every client has gone: anything but 0 is for nobody."""
    first = sampler.latest()
    await trio.sleep(_IDLE_WINDOW)
    last = sampler.latest()
    if first.tokens is None or last.tokens is None or last.at <= first.at:
        return None
    return (last.tokens - first.tokens) / (last.at - first.at)


def _report(
    run: _Run,
    not_measured: list[str],
    phases: list[PhaseResult],
    initial: Sample,
    idle_rate: float | None,
) -> Report:
    plan, sampler, kind = run.plan, run.sampler, run.kind
    samples = sampler.samples
    gaps = [(b.sent - a.sent) * 1000 for a, b in itertools.pairwise(samples)]
    scrapes = [(s.received - s.sent) * 1000 for s in samples]
    if sampler.failures:
        not_measured.append(
            f"{sampler.failures} scrape(s) failed, their samples missing (the last: "
            f"{sampler.last_failure})"
        )
    if kind.holds == "frontend":
        not_measured.append("the engine's release: these gauges count the frontend's requests")
    if kind.tokens is None:
        not_measured.append("tokens after leaving: no generated-token counter")
    return Report(
        started=run.started_utc,
        url=run.target.url,
        api=run.target.api,
        model=run.target.model,
        metrics_urls=list(plan.metrics_urls),
        server=kind.name,
        in_flight=[str(series) for series in kind.in_flight],
        tokens=str(kind.tokens) if sampler.latest().tokens is not None else None,
        holds=kind.holds,
        tokens_lower_bound=kind.tokens_lower_bound,
        concurrency=plan.concurrency,
        requests=plan.requests,
        max_tokens=run.target.max_tokens,
        leave_delay_ms=run.rule.delay * 1000,
        mid_stream_chunks=run.rule.chunks,
        settle_s=plan.settle,
        sample_every_ms=percentile(gaps, 0.5) or 0.0,
        scrape_ms=percentile(scrapes, 0.5) or 0.0,
        scrape_failures=sampler.failures,
        limits=list(kind.limits),
        not_measured=not_measured,
        phases=phases,
        idle_tokens_per_s=idle_rate,
        held_at_end=round(sampler.latest().in_flight - initial.in_flight),
        timeline={
            "t": [s.at - run.started for s in samples],
            "in_flight": [s.in_flight for s in samples],
            "tokens": [s.tokens for s in samples],
        },
    )

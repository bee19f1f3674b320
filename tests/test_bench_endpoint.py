"""``trio-sglang bench-endpoint`` against servers whose truth is known.

- Against ``trio-sglang serve`` on the SimEngine (a subprocess), its figures
  must agree with the server's own counters: every client that left is a
  cancellation there, every completed one a finished request at the engine,
  nothing left held, at most one token made after a client left (the engine
  stops within a millisecond; a token takes 20 ms), and each release within
  two samples plus 50 ms of the server's own abort delay.
- Against a server that never stops generating for a client that left (an
  ASGI app in this process, on hypercorn): it must report every such
  request as leaked, and the tokens made for nobody.
- Through sglang-router: the router notices a gone client only when it
  writes to it, so with the workers' SSE heartbeats off a client that left
  before the first token is held until that token; with them on, within a
  heartbeat.

Everything runs over loopback, every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import parser

from _processes import Process, start_router, start_workers
from trio_sglang._cli._parser import build_parser
from trio_sglang.bench_endpoint._command import plan_from_options, printable
from trio_sglang.bench_endpoint._departures import ALL_PHASES
from trio_sglang.bench_endpoint._report import (
    PhaseResult,
    Report,
    compare_table,
    load,
    percentile,
    table,
)
from trio_sglang.bench_endpoint._run import run_bench

TIMEOUT = 180


# -- against trio-sglang serve on the SimEngine ---------------------------------------------

#: The SimEngine's timing: a long wait before the first token, so that leaving
#: before it has room; tokens 20 ms apart. Its other delays: 5 ms of
#: tokenizing and 1 ms to dispatch, serve's defaults.
FIRST_TOKEN_DELAY = 0.3
TOKEN_INTERVAL = 0.02
SERVE_ARGS = ("--sim-first-token-delay", str(FIRST_TOKEN_DELAY))
SERVE_ARGS += ("--sim-token-interval", str(TOKEN_INTERVAL))
#: The run's size (the warm-up adds CONCURRENCY requests of 2 tokens).
CONCURRENCY, REQUESTS, MAX_TOKENS = 4, 8, 16
#: How much later than the server's own abort delay the tool may see a release:
#: its two sampling intervals (up to one before the sample, half of one in it)
#: and 50 ms for a busy 2-core machine.
SLACK_MS = 50.0


def bench(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_sglang", "bench-endpoint", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def server_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's own page, read by prometheus_client: nothing of the tool's reader."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def delta(after: dict[Any, float], before: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def abort_delay_p99_ms(after: dict[Any, float], before: dict[Any, float]) -> float:
    """The server's own p99 abort delay over the run: the upper bound of its histogram bucket."""
    name = "trio_sglang_abort_delay_seconds_bucket"
    bounds = sorted(float(dict(labels)["le"]) for sample, labels in after if sample == name)
    counts = [(bound, delta(after, before, name, le=_le(bound))) for bound in bounds]
    total = counts[-1][1]
    return next(bound for bound, count in counts if count >= 0.99 * total) * 1000


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else str(bound)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[str]:
    ((process, url),) = start_workers(["serve"], tmp_path, *SERVE_ARGS)
    try:
        yield url
    finally:
        process.stop()


@pytest.mark.slow
def test_against_serve_the_figures_match_the_servers_own(serve: str, tmp_path: Path) -> None:
    before = server_metrics(serve)
    out = tmp_path / "serve.json"
    result = bench(
        "--url", serve, "--api", "sglang-generate", "--concurrency", str(CONCURRENCY),
        "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--json", str(out),
        "--plot", str(tmp_path / "serve.png"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    after = server_metrics(serve)
    report = load(out)
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert "bench-endpoint: [9/9] mid_stream:reset: wave 2/2" in result.stderr  # the progress
    assert "release after the client left" in result.stdout

    assert report.server == "serve"
    assert report.tokens == 'trio_sglang_sim_events_total{kind="token"}'
    phases = {phase.name: phase for phase in report.phases}
    assert list(phases) == [phase.name for phase in ALL_PHASES]
    leaving = [phase for phase in report.phases if phase.name != "stay"]
    assert all(phase.left == REQUESTS and phase.failed == 0 for phase in leaving)

    # Nothing held, at the end or after any wave; the engine agrees.
    assert report.held_at_end == 0
    assert all(phase.leaked == 0 and phase.stale == 0 for phase in report.phases)
    assert server_value(after, "trio_sglang_engine_live_requests") == 0
    assert delta(after, before, "trio_sglang_sim_events_total", kind="abort_lost") == 0

    # Every client that left is a cancellation at the server; those that left right
    # after sending may be gone before the server reads their request (then it has
    # nothing to cancel).
    cancelled = sum(
        delta(after, before, "trio_sglang_cancellations_total", phase=where)
        for where in ("before_headers", "before_first_token", "mid_stream")
    )
    early = sum(phases[f"before_headers:{how}"].left for how in ("close", "reset"))
    left = sum(phase.left for phase in leaving)
    assert left - early <= cancelled <= left
    # Every completed request (the control and the warm-up) finished at the engine.
    finished = delta(after, before, "trio_sglang_sim_events_total", kind="finished")
    assert finished == phases["stay"].completed + CONCURRENCY == REQUESTS + CONCURRENCY

    # Tokens: the control received exactly what the engine made for it; a client
    # that left cost at most the one token on its way.
    stay = phases["stay"]
    assert stay.tokens_generated == stay.tokens_received == REQUESTS * MAX_TOKENS
    for phase in leaving:
        assert phase.wasted_tokens is not None
        assert phase.wasted_tokens <= phase.left, phase.name
    made = delta(after, before, "trio_sglang_sim_events_total", kind="token")
    measured = sum(phase.tokens_generated or 0 for phase in report.phases)
    assert measured == made - CONCURRENCY * 2  # all but the warm-up's, which no phase counts
    assert report.idle_tokens_per_s == 0

    # Release times: the gauges saw every request that got as far as the engine, and
    # each release within the slack of the server's own abort delay.
    for where in ("before_first_token", "first_token", "mid_stream"):
        for how in ("close", "reset"):
            phase = phases[f"{where}:{how}"]
            assert phase.unseen == 0, phase.name
            assert len(phase.release_ms) == REQUESTS, phase.name
    bound = abort_delay_p99_ms(after, before) + 2 * report.sample_every_ms + SLACK_MS
    worst = max(max(phase.release_ms) for phase in leaving)
    assert worst <= bound, (worst, bound)

    # The control's view: the SimEngine's timing.
    ttft = percentile(stay.ttft_ms, 0.5)
    itl = percentile(stay.itl_ms, 0.5)
    assert ttft is not None
    assert itl is not None
    assert FIRST_TOKEN_DELAY * 1000 <= ttft <= FIRST_TOKEN_DELAY * 1000 + 100
    assert TOKEN_INTERVAL * 1000 - 5 <= itl <= TOKEN_INTERVAL * 1000 + 10
    print(result.stdout)


def server_value(after: dict[Any, float], name: str) -> float:
    return after[name, ()]


# -- against a server that never stops generating -------------------------------------------


class BadServer:
    """An OpenAI-style streaming server that generates for a gone client forever.

    A request's generator task lives in the server's nursery, not the
    response's: when the client disconnects, the response ends, and the
    generator goes on making a token every 10 ms for nobody. A client that
    reads to the end gets its tokens and the generator stops. It exports a
    gauge of running generators and a counter of tokens, in Prometheus text.
    """

    TOKEN_INTERVAL = 0.01

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.running = 0
        self.tokens = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # nothing to start or stop
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": f"{message['type']}.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["path"] == "/metrics":
            page = (
                "# TYPE bad_requests_running gauge\n"
                f"bad_requests_running {self.running}\n"
                "# TYPE bad_generated_tokens_total counter\n"
                f"bad_generated_tokens_total {self.tokens}\n"
            )
            await self.answer(send, "text/plain; version=0.0.4", page.encode())
        elif scope["path"] == "/v1/models":
            await self.answer(send, "application/json", b'{"data": [{"id": "bad"}]}')
        else:
            await self.stream(receive, send)

    async def answer(self, send: Any, content_type: str, body: bytes) -> None:
        headers = [(b"content-type", content_type.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def stream(self, receive: Any, send: Any) -> None:
        request = b""
        while True:
            message = await receive()
            request += message.get("body", b"")
            if not message.get("more_body"):
                break
        max_tokens = json.loads(request)["max_tokens"]
        tokens_to, tokens_from = trio.open_memory_channel[str](math.inf)
        self.nursery.start_soon(self.generate, tokens_to, max_tokens)
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async with trio.open_nursery() as response, tokens_from:

            async def until_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                response.cancel_scope.cancel()  # closing tokens_from: the generator sees it

            response.start_soon(until_disconnect)
            async for token in tokens_from:
                event = {"choices": [{"index": 0, "delta": {"content": token}}]}
                body = f"data: {json.dumps(event)}\n\n".encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            response.cancel_scope.cancel()

    async def generate(self, tokens_to: trio.MemorySendChannel[str], max_tokens: int) -> None:
        self.running += 1
        made, gone = 0, False
        while gone or made < max_tokens:
            await trio.sleep(self.TOKEN_INTERVAL)
            self.tokens += 1
            made += 1
            if not gone:
                try:
                    tokens_to.send_nowait(" tok")
                except trio.BrokenResourceError:
                    gone = True  # and so it goes on, for nobody
        tokens_to.close()
        self.running -= 1


@pytest.fixture
async def bad_server() -> AsyncIterator[tuple[str, BadServer]]:
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        server = BadServer(nursery)
        binds = await nursery.start(hypercorn_serve, server, config)
        yield binds[0], server
        nursery.cancel_scope.cancel()


# A client that leaves mid-read drops httpx's chain of async generators over the
# response unexhausted (httpx closes the response, not them): trio's finalizer
# closes them and warns (a ResourceWarning, ignored outside the test suite).
@pytest.mark.filterwarnings(
    r"ignore:Async generator '(httpx|httpcore)\..*' was garbage collected:ResourceWarning"
)
@pytest.mark.slow
async def test_a_server_that_never_stops_is_reported_as_leaking_and_wasting(
    bad_server: tuple[str, BadServer],
) -> None:
    url, server = bad_server
    args = build_parser().parse_args(
        [
            "bench-endpoint", "--url", url, "--concurrency", "2", "--requests", "4",
            "--max-tokens", "10", "--mid-stream-chunks", "3", "--settle", "0.3",
            "--phases", "stay", "first_token:reset", "mid_stream:close",
            "--metrics", "in_flight=bad_requests_running,tokens=bad_generated_tokens_total",
        ]
    )  # fmt: skip
    with trio.fail_after(60):
        report = await run_bench(plan_from_options(args), lambda message: None)
    phases = {phase.name: phase for phase in report.phases}

    assert phases["stay"].leaked == 0  # a client that reads to the end is let go
    for name in ("first_token:reset", "mid_stream:close"):
        phase = phases[name]
        assert phase.left == 4
        assert phase.leaked == 4, name  # none ever released
        assert phase.release_ms == []
        assert phase.wasted_tokens is not None
        assert phase.wasted_tokens > 0, name
    # Each wave waits for the gauges, then probes: still held, so leaked. At the end
    # all 8 still run, 100 tokens a second each.
    assert report.held_at_end == server.running == 8
    assert report.idle_tokens_per_s is not None
    assert report.idle_tokens_per_s > 8 * 50  # 8 x 100/s, on a busy machine at least half
    text = table(report)
    assert "8 request(s) still held" in text
    print(text)


# -- through sglang-router ------------------------------------------------------------------

ROUTER_FIRST_TOKEN = 1.0
#: Not a multiple of the 0.1 s heartbeat: the next one is due 50 ms after the leave.
ROUTER_LEAVE = 0.25


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[Callable[[str], tuple[str, str]]]:
    """Start a worker (with extra args) behind its own router: (router URL, worker URL)."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router)")
    started: list[Process] = []

    def start(name: str, *args: str) -> tuple[str, str]:
        log_dir = tmp_path / name
        log_dir.mkdir()
        ((worker, worker_url),) = start_workers(
            [f"{name}-worker"], log_dir, "--sim-first-token-delay", str(ROUTER_FIRST_TOKEN), *args
        )
        started.append(worker)
        router, router_url = start_router(
            log_dir, [worker_url], "--log-level", "warn", "--shutdown-grace-period-secs", "1",
            watched=[worker],
        )  # fmt: skip
        started.append(router)
        return router_url, worker_url

    try:
        yield start
    finally:
        for process in reversed(started):
            process.stop()


@pytest.mark.slow
def test_through_the_router_heartbeats_decide_the_before_first_token_delay(
    routed: Callable[[str], tuple[str, str]], tmp_path: Path
) -> None:
    delays = {}
    for name, args in (("quiet", ("--sse-heartbeat", "0")), ("heartbeat", ())):
        router, worker = routed(name, *args)
        out = tmp_path / f"{name}.json"
        result = bench(
            "--url", router, "--metrics-url", f"{worker}/metrics", "--api", "openai-completions",
            "--phases", "before_first_token:close", "--concurrency", "4", "--requests", "4",
            "--leave-delay", str(ROUTER_LEAVE), "--json", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        (phase,) = load(out).phases
        assert phase.left == 4
        assert phase.leaked == 0
        assert len(phase.release_ms) == 4
        delays[name] = percentile(phase.release_ms, 0.5)
        print(result.stdout)
    # Heartbeats off: the router writes nothing to the gone client until the first token.
    quiet, heartbeat = delays["quiet"], delays["heartbeat"]
    assert quiet is not None
    assert heartbeat is not None
    assert quiet >= (ROUTER_FIRST_TOKEN - ROUTER_LEAVE) * 1000 - 100
    # On: within one 0.1 s heartbeat, plus the sampling, plus a busy machine.
    assert heartbeat <= 100 + 2 * 10 + SLACK_MS + 100
    print(f"before the first token, through the router: {quiet:.0f} ms quiet, {heartbeat:.0f} ms")


# -- the command line -----------------------------------------------------------------------


def test_saved_runs_compare_side_by_side(tmp_path: Path) -> None:
    report = made_up_report()
    for name in ("a", "b"):
        report.save(tmp_path / f"{name}.json")
    assert load(tmp_path / "a.json") == report
    result = bench("--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["phase", "a", "b"]
    assert "mid_stream:reset" in result.stdout
    assert "12.0 / 40.0, 1, 2.50" in result.stdout
    assert compare_table([("a", report)]).startswith("phase")


def test_a_figure_that_is_not_finite_is_saved_as_null(tmp_path: Path) -> None:
    """Without this rule a lying server's ``+Inf`` counter wrote a bare ``NaN`` into the file:
    not JSON, which strict readers (``jq``, browsers, ``allow_nan=False``) refuse."""
    report = dataclasses.replace(made_up_report(), idle_tokens_per_s=math.inf)
    report.phases[0].tokens_generated = math.nan
    report.save(tmp_path / "run.json")

    def not_json(constant: str) -> None:
        raise AssertionError(f"{constant} in the saved file")

    saved = json.loads((tmp_path / "run.json").read_text(), parse_constant=not_json)
    assert saved["idle_tokens_per_s"] is None
    assert saved["phases"][0]["tokens_generated"] is None


def test_what_a_server_says_reaches_the_terminal_escaped() -> None:
    """Without this rule a lying server's terminal escape codes reached the operator's screen."""
    assert printable("line\x1b[2J\x1b]0;owned\x07 ok\nnext\r") == (
        "line\\x1b[2J\\x1b]0;owned\\x07 ok\nnext\\r"
    )


def made_up_report() -> Report:
    phase = PhaseResult(
        name="mid_stream:reset", requests=2, left=2, completed=0, failed=0, errors={},
        release_ms=[12.0, 40.0], resolution_ms=14.0, unseen=0, stale=0, leaked=1, early=0,
        tokens_received=16, tokens_generated=21.0, wasted_tokens=5.0, ttft_ms=[300.0, 301.0],
        itl_ms=[20.0],
        window=(1.0, 2.0), leaves=[1.5, 1.6], notes=[],
    )  # fmt: skip
    return Report(
        started="2026-12-03T00:00:00Z", url="http://127.0.0.1:8000", api="openai-chat",
        model="m", metrics_urls=["http://127.0.0.1:8000/metrics"], server="serve",
        in_flight=["trio_sglang_engine_live_requests"], tokens=None, holds="engine",
        tokens_lower_bound=False, concurrency=2, requests=2, max_tokens=16,
        leave_delay_ms=150.0, mid_stream_chunks=8, settle_s=3.0, sample_every_ms=10.0,
        scrape_ms=1.0, scrape_failures=0, limits=[], not_measured=[], phases=[phase],
        idle_tokens_per_s=0.0, held_at_end=1,
        timeline={"t": [0.0], "in_flight": [0.0], "tokens": [None]},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "trio-sglang bench-endpoint needs --url"),
        (["--url", "127.0.0.1:8000"], "--url must start with http://"),
        (["--url", "http://127.0.0.1:1"], "cannot read the metrics at http://127.0.0.1:1/metrics"),
        (["--url", "http://x", "--phases", "soon"], "unknown phase 'soon'"),
        (["--url", "http://x", "--metrics", "nope"], "--metrics: expected a server kind"),
        (["--url", "http://x", "--max-tokens", "4"], "--mid-stream-chunks must be below"),
        (["--compare", "/nonexistent.json"], "--compare: cannot read /nonexistent.json"),
    ],
)
def test_what_cannot_run_is_one_line_on_stderr(args: list[str], message: str) -> None:
    result = bench(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(message), lines


@pytest.mark.parametrize("hidden", ["httpx", "matplotlib"])
def test_without_the_bench_extra_it_says_so_in_one_line(hidden: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys

        sys.modules[{hidden!r}] = None  # as if not installed
        from trio_sglang._cli._main import main

        sys.exit(main(["bench-endpoint", "--url", "http://127.0.0.1:1"]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "trio-sglang bench-endpoint needs the bench extra: pip install 'trio-sglang[bench]'"
    )

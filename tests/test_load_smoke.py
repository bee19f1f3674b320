"""The loopback load test (``benchmarks/load.py``, ``nox -s load``) and what the server gives it.

The runner's pure parts are checked on fixed inputs: the histogram quantile
(linear interpolation inside a bucket), how a request's end is classified,
and the verdict on scrapes of a real ``ServerMetrics``. The server side: the
metrics the runner judges by (``process_resident_memory_bytes``, the
SimEngine's event counts) and ``SimEngine(keep_trace=False)``, which a
long-running server needs. One tiny run of the whole runner (a server
subprocess, a few clients for a second, real time) closes it, and one of
the edge scenario (the same, then beside one hostile client of each kind: a
non-reader, a trickler, a zero-window HTTP/2 client, a bad KV peer's); they
assert counts and verdicts, never timings.
"""

from __future__ import annotations

import io
import json
import math
import random
import sys
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from trio_sglang.server import ServerMetrics

INF = math.inf


@pytest.fixture(scope="module")
def load() -> Any:
    """The runner's modules, imported from benchmarks/ as the script imports them."""
    import _load_bad_peer
    import _load_clients
    import _load_config
    import _load_hostile
    import _load_metrics
    import _load_report
    import _output
    import load as runner

    return SimpleNamespace(
        bad_peer=_load_bad_peer,
        clients=_load_clients,
        config=_load_config,
        hostile=_load_hostile,
        metrics=_load_metrics,
        report=_load_report,
        progress=_output.Progress,
        runner=runner,
    )


# -- one vocabulary of phases -------------------------------------------------------


def test_every_phase_a_client_leaves_in_is_a_word_of_the_projects_vocabulary(load: Any) -> None:
    """The load test, ``bench-endpoint`` and the prefill/decode benchmark name the moment a
    client left as the server does
    (whose phases, and the cancel benchmark's, are typed by it: mypy checks those)."""
    from trio_sglang._phases import PHASES
    from trio_sglang.bench_endpoint._departures import LEAVES

    left = {outcome.removeprefix("left_") for outcome in load.clients.LEFT}
    assert left <= set(PHASES), left - set(PHASES)
    assert set(LEAVES) - {"stay"} <= set(PHASES), set(LEAVES) - set(PHASES)
    import _disagg_metrics

    assert set(_disagg_metrics.PHASES) <= set(PHASES), set(_disagg_metrics.PHASES) - set(PHASES)


# -- the SimEngine and the server's metrics ----------------------------------------


async def test_keep_trace_false_keeps_counts_not_events(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ts.SimEngine(keep_trace=False)
    request = {"text": "hi", "rid": "r1", "sampling_params": {"max_new_tokens": 3}}
    async with engine.running():
        outputs = [out async for out in engine.generate(request)]
    assert len(outputs) == 3
    assert list(engine.trace) == []
    counts = engine.trace.counts
    assert (counts["registered"], counts["dispatched"], counts["token"]) == (1, 1, 3)
    assert counts["finished"] == 1
    with pytest.raises(ValueError, match="keep_trace must be a bool"):
        ts.SimEngine(keep_trace="no")  # type: ignore[arg-type]


async def test_default_trace_keeps_events_and_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ts.SimEngine()
    async with engine.running():
        async for _ in engine.generate({"text": "hi", "rid": "r1"}):
            pass
    assert engine.trace.counts == Counter(event.kind for event in engine.trace)
    assert engine.trace.counts["token"] > 0


async def test_metrics_export_process_memory_and_sim_events(load: Any) -> None:
    engine = ts.SimEngine(keep_trace=False)
    metrics = ServerMetrics()
    async with ts.open_worker(engine, observer=metrics) as worker:
        metrics.watch(worker)
        engine.trace.record("abort_lost", "a-rid")  # as the scheduler records one
        scrape = load.metrics.Scrape.parse(metrics.render().decode())
    events = scrape.by_label("trio_sglang_sim_events_total", "kind")
    assert events["abort_lost"] == 1
    assert set(events) >= {"registered", "token", "abort_applied", "released"}  # every kind
    if sys.platform == "linux":  # prometheus_client's ProcessCollector reads /proc
        assert scrape.value("process_resident_memory_bytes") > 0
        assert scrape.value("process_cpu_seconds_total") > 0
    bounds = [bound for bound, _ in scrape.buckets("trio_sglang_abort_delay_seconds")]
    assert bounds[0] == 0.0001
    assert bounds[-1] == INF


# -- the runner's pure parts ---------------------------------------------------------


def test_histogram_quantile_interpolates_inside_buckets(load: Any) -> None:
    quantile = load.metrics.histogram_quantile
    buckets = [(0.001, 4.0), (0.002, 8.0), (0.005, 8.0), (INF, 10.0)]
    assert quantile(0.25, buckets) == pytest.approx(0.001 * 2.5 / 4)  # rank 2.5 of 4 in [0, 1 ms]
    assert quantile(0.5, buckets) == pytest.approx(
        0.001 + 0.001 * 1 / 4
    )  # rank 5: 1 of 4 in (1, 2]
    assert quantile(0.8, buckets) == pytest.approx(0.002)  # the top of its bucket
    assert quantile(0.99, buckets) == 0.005  # in +Inf: the largest finite bound
    assert quantile(0.5, [(0.001, 0.0), (INF, 0.0)]) is None
    with pytest.raises(ValueError, match="q must be"):
        quantile(0.0, buckets)


def test_scrape_reads_labels_and_differences(load: Any) -> None:
    text = (
        "# TYPE x_seconds histogram\n"
        'x_seconds_bucket{le="0.001"} 3\nx_seconds_bucket{le="+Inf"} 5\n'
        "x_seconds_count 5\nx_seconds_sum 0.01\n"
        "# TYPE r_total counter\n"
        'r_total{endpoint="/a",outcome="ok"} 2\nr_total{endpoint="/b",outcome="ok"} 1\n'
    )
    scrape = load.metrics.Scrape.parse(text)
    assert scrape.by_label("r_total", "outcome") == {"ok": 3.0}
    assert scrape.value("r_total", endpoint="/b", outcome="ok") == 1.0
    before = [(0.001, 1.0), (INF, 1.0)]
    assert load.metrics.bucket_delta(scrape.buckets("x_seconds"), before) == [
        (0.001, 2.0),
        (INF, 4.0),
    ]
    with pytest.raises(load.metrics.MissingMetric):
        scrape.value("r_total", outcome="ok")  # a sample needs all its labels
    with pytest.raises(load.metrics.MissingMetric):
        scrape.buckets("y_seconds")


@pytest.mark.parametrize(
    ("seen", "leave_after", "cut", "outcome", "reason"),
    [
        ({"status": 200, "tokens": 16, "done": True}, None, False, "completed", None),
        ({"status": 200, "tokens": 16, "done": True}, 9.0, False, "completed", None),
        ({"status": 200, "tokens": 3}, 1.0, True, "left_mid_stream", None),
        ({"status": 200}, 0.05, True, "left_before_first_token", None),
        ({}, 0.01, True, "left_before_headers", None),
        ({"status": 200, "tokens": 3}, None, True, "failed", "timed out mid stream"),
        ({}, None, True, "failed", "timed out before headers"),
        ({"status": 200, "tokens": 3}, None, False, "failed", "stream ended without [DONE]"),
        ({"status": 503}, None, False, "failed", "HTTP 503"),
        ({"status": 200, "error": 503, "done": True}, None, False, "failed", "error event 503"),
    ],
)
def test_how_a_request_ended(
    load: Any,
    seen: dict[str, Any],
    leave_after: float | None,
    cut: bool,
    outcome: str,
    reason: str | None,
) -> None:
    clients = load.clients
    tally = clients.Tally()
    assert clients._outcome(clients._Seen(**seen), leave_after, cut, tally) == outcome
    assert list(tally.failures) == ([] if reason is None else [reason])


def test_leave_moments_fall_before_the_first_token_or_mid_stream(load: Any) -> None:
    shape = load.config.Config().shape()
    rng = random.Random(0)
    moments = [shape.leave_after(rng) for _ in range(3000)]
    left = [m for m in moments if m is not None]
    assert 0.28 < len(left) / len(moments) < 0.39  # a third
    last_token = shape.first_token_after + (shape.max_tokens - 1) * shape.token_interval
    early = [m for m in left if m < shape.first_token_after]
    assert 0.4 < len(early) / len(left) < 0.6  # half of them before the first token
    assert all(0 <= m <= last_token for m in left)


def test_command_line(load: Any) -> None:
    runner = load.runner
    parse = runner.build_parser().parse_args
    quick = runner.config_from_args(parse(["--quick"]))
    assert (quick.clients, quick.duration) == (200, 8.0)
    full = runner.config_from_args(parse(["--clients", "10", "--disconnect-fraction", "0.5"]))
    assert (full.clients, full.duration, full.disconnect_fraction) == (10, 30.0, 0.5)
    assert "--sim-token-interval" in full.serve_args()
    for bad in (["--clients", "0"], ["--disconnect-fraction", "1.5"], ["--duration", "-1"]):
        with pytest.raises(SystemExit):
            parse(bad)


def test_edge_command_line(load: Any) -> None:
    runner = load.runner
    parse = runner.build_parser().parse_args

    def edge(*argv: str) -> tuple[int, int, int, int]:
        args = parse(["--scenario", "edge", *argv])
        chosen = runner.edge_from_args(args, runner.config_from_args(args))
        return chosen.nonreaders, chosen.tricklers, chosen.zero_window, chosen.bad_peers

    assert edge() == (50, 50, 50, 10)  # 10 % of 1,000 clients, at most 50 of each (10 peers)
    assert edge("--quick") == (20, 20, 20, 10)
    assert edge("--clients", "3") == (1, 1, 1, 1)
    assert edge("--tricklers", "0", "--nonreaders", "7") == (7, 0, 50, 10)
    assert edge("--zero-window", "0", "--bad-peers", "3") == (50, 50, 0, 3)
    assert "--client-stall-timeout" in load.config.EdgeConfig().serve_args()
    with pytest.raises(SystemExit):
        parse(["--scenario", "edge", "--nonreaders", "-1"])


def test_a_zero_window_client_grants_no_window_and_opens_its_streams(load: Any) -> None:
    """Its bytes, read by an HTTP/2 server: a window of 0 from the start, and every stream
    a whole streaming ``/generate`` request, which a server speaking HTTP/2 could not answer."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    preface = load.hostile.zero_window_preface("127.0.0.1:1", "hi", 1024, 3)
    assert preface.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    events = server.receive_data(preface)
    settings = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
    window = settings[0].changed_settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE]
    assert window.new_value == 0
    requests = [e for e in events if isinstance(e, h2.events.RequestReceived)]
    assert [dict(e.headers)[b":path"] for e in requests] == [b"/generate"] * 3
    bodies = [json.loads(e.data) for e in events if isinstance(e, h2.events.DataReceived)]
    assert [body["stream"] for body in bodies] == [True] * 3
    assert len([e for e in events if isinstance(e, h2.events.StreamEnded)]) == 3


# -- the verdict ---------------------------------------------------------------------------


def _report(load: Any, before: Any, after: Any, tally: Any, **overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "config": load.config.Config(clients=2, duration=1.0),
        "tally": tally,
        "warmup": load.clients.Tally(),
        "before": before,
        "after": after,
        "settle_s": 0.01,
        "peak_rss": 50e6,
        "exit_status": 0,
        "stop_s": 0.1,
        "log_levels": {"INFO": 2},
        "log_notable": [],
        "load_s": 1.0,
        "runtime_s": 3.0,
        "client_cpu_s": 0.1,
        "load_average": (0.1, 0.2),
    }
    return load.report.LoadReport(**(fields | overrides))


async def test_the_verdict(load: Any) -> None:
    engine = ts.SimEngine(keep_trace=False)
    metrics = ServerMetrics()

    def scrape() -> Any:
        return load.metrics.Scrape.parse(metrics.render().decode())

    async with ts.open_worker(engine, observer=metrics) as worker:
        metrics.watch(worker)
        before = scrape()
        for seconds in (0.0002, 0.0004, 0.0008, 0.003):
            metrics.cleanup_finished(seconds, released=True)
        clean = scrape()
        engine.trace.record("abort_lost", "a-rid")
        lost = scrape()

    tally = load.clients.Tally()
    tally.outcomes["/generate", "completed"] = 3
    tally.outcomes["/v1/completions", "left_mid_stream"] = 1
    tally.statuses[200] = 4
    report = _report(load, before, clean, tally)
    assert report.passed, report.format()
    delay = report.abort_delay()
    assert delay["cleanups"] == 4
    assert 0.00025 < delay["p50_s"] <= 0.0005
    assert json.loads(json.dumps(report.to_json({}), allow_nan=False))["passed"] is True
    assert "verdict: PASS" in report.format()

    def failed(report: Any) -> list[str]:
        return [check.what for check in report.checks if not check.met]

    assert failed(_report(load, before, lost, tally)) == ["aborts lost at the engine"]
    assert failed(_report(load, before, clean, tally, exit_status=None)) == [
        "server exits 0 on SIGINT"
    ]
    tally.statuses[503] += 1
    tally.outcomes["/generate", "failed"] += 1
    tally.failures["HTTP 503"] += 1
    broken = _report(load, before, clean, tally)
    assert failed(broken) == [
        "responses 5xx (status, or an error event in the stream)",
        "requests failed",
    ]
    assert "verdict: FAIL" in broken.format()


# -- the whole runner, tiny --------------------------------------------------------------


# httpx sends a JSON body through an async generator that httpcore does not close
# when the send is cancelled: a client that leaves that early hands it to trio's
# finalizer, which warns (a ResourceWarning, ignored outside the test suite).
@pytest.mark.filterwarnings(
    r"ignore:Async generator 'httpx\._content\.ByteStream\.__aiter__' was garbage collected"
    ":ResourceWarning"
)
async def test_a_tiny_run_passes(load: Any) -> None:
    config = load.config.Config(
        clients=6,
        duration=1.0,
        disconnect_fraction=0.5,
        max_tokens=4,
        token_interval=0.01,
        first_token_delay=0.01,
        ramp=0.2,
        warmup_clients=2,
        warmup_duration=0.2,
    )
    report = await load.runner.run_load(config, load.progress(5, stream=io.StringIO()))
    assert report.passed, report.format()
    server = report.server()
    assert server["engine_live_requests"] == server["aborts_lost"] == 0
    assert server["exit_status"] == 0
    assert server["rss_bytes"]["before"] > 0
    assert report.tally.count() > 0
    assert report.tally.tokens > 0


@pytest.mark.filterwarnings(
    r"ignore:Async generator 'httpx\._content\.ByteStream\.__aiter__' was garbage collected"
    ":ResourceWarning"
)
async def test_a_tiny_edge_run(load: Any) -> None:
    config = load.config.Config(
        clients=4,
        duration=1.0,
        disconnect_fraction=0.5,
        max_tokens=4,
        token_interval=0.01,
        first_token_delay=0.01,
        ramp=0.2,
        warmup_clients=2,
        warmup_duration=0.2,
    )
    # A token every 10 ms fills a non-reader's buffers within a second; bounds to match.
    # Zero-window and bad-peer clients start over every 0.2 s, so that a bad peer's
    # requests take both routes to the peer within the second.
    edge = load.config.EdgeConfig(
        nonreaders=1,
        tricklers=1,
        zero_window=1,
        bad_peers=1,
        stall_timeout=0.5,
        read_timeout=0.5,
        trickle_interval=0.1,
        pace=0.2,
        kv_wait_timeout=0.5,
        hold_bound=20.0,
        flooders=1,
        pipeliners=2,
        resetters=1,
        fanout=2,
        fanout_children=16,
        clients=4,
    )
    progress = load.progress(load.runner.EDGE_STEPS, stream=io.StringIO())
    report = await load.runner.run_edge(config, edge, progress)
    # Every invariant holds; the ITL target is a timing, judged by the benchmark on a quiet
    # machine at its full size, never asserted here.
    failed = [check.what for check in report.checks if check.met is False]
    assert [what for what in failed if "p99 ITL" not in what] == [], report.format()
    hostile = report.hostile
    readers, zero_window = hostile.nonreaders, hostile.zero_window
    assert readers.let_go["reset"] == len(readers.seconds) > 0
    assert set(hostile.trickles) == {"HTTP 408"}
    assert report.dropped().get("stalled", 0) + report.dropped().get("behind", 0) > 0
    # HTTP/2 is on: each zero-window stream is reset once its answer waits, and the
    # connection with the last of them.
    assert zero_window.count() == len(zero_window.seconds) > 0
    assert "held past the bound" not in zero_window.let_go
    assert max(zero_window.after_answer) <= report.zero_window_bound()
    peers = report.peers
    assert peers.requests.unexpected() == {}
    by_route = peers.to_json()["requests"]
    assert all(sum(outcomes.values()) > 0 for outcomes in by_route.values()), by_route
    assert sum(peers.peer.answers().values()) > 0
    assert not peers.peer.past_bound
    assert peers.decode.exit_status == 0
    assert peers.decode.live() == 0
    for phase in (report.baseline, report.loaded):
        assert phase.server()["engine_live_requests"] == 0
        assert phase.tally.count() > 0
        assert phase.tally.itl
        assert phase.rss is not None
    assert report.itl_ratio() is not None
    assert json.loads(json.dumps(report.to_json({}), allow_nan=False))["hostile"]

"""The serving benchmark (``benchmarks/serve_throughput.py``): a tiny run, and its parts.

The client's counting is checked on a response split at every byte (a marker
cut between two reads counts once), the floor's app on the bytes it streams
(the recorded events, paced, then ``[DONE]``), and one tiny run of the whole
benchmark (a few streams, half a second a cell, real processes on loopback)
on what it must always hold: every cell read chunks, no request failed, the
floor sent one token per event, the report renders and its files are
written. Never a timing.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio


@pytest.fixture(scope="module")
def bench() -> Any:
    """The benchmark's modules, imported from benchmarks/ as the script imports them."""
    import _output
    import _sse_client
    import _sse_floor
    import _throughput_report
    import serve_throughput

    return SimpleNamespace(
        client=_sse_client,
        floor=_sse_floor,
        runner=serve_throughput,
        output=_output,
        report=_throughput_report,
    )


EVENTS = [
    b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
    b'data: {"choices": [{"delta": {"content": "b\\n\\ndata: x"}}]}\n\n',
    b'data: {"choices": [{"finish_reason": "length"}]}\n\n',
]


def chunked(*pieces: bytes) -> bytes:
    """A 200 SSE response in chunked transfer-encoding, as hypercorn frames it."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    head = b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + body + b"0\r\n\r\n"


RESPONSE = chunked(b"\n\n", EVENTS[0], EVENTS[1] + EVENTS[2], b"data: [DONE]\n\n")


def read(bench: Any, pieces: list[bytes]) -> tuple[Any, list[str | None]]:
    reading = bench.client.Reading(streams=1)
    response = bench.client.Response(asked=3)
    return reading, [response.take(piece, reading) for piece in pieces]


def test_the_client_counts_every_event_once_wherever_a_read_ends(bench: Any) -> None:
    cuts = [[RESPONSE[:at], RESPONSE[at:]] for at in range(1, len(RESPONSE))]
    for pieces in [*cuts, [RESPONSE[i : i + 1] for i in range(len(RESPONSE))]]:
        reading, said = read(bench, pieces)
        assert said[-1] == bench.client.ENDED
        assert set(said[:-1]) == {None}
        assert (reading.chunks, reading.heartbeats, reading.responses) == (3, 1, 1)
        assert (reading.tokens_completed, reading.chunks_completed) == (3, 3)


def test_the_client_tells_a_failed_response(bench: Any) -> None:
    assert read(bench, [b"HTTP/1.1 503 \r\ncontent-length: 0\r\n\r\n"])[1] == ["HTTP 503"]
    assert read(bench, [chunked(EVENTS[0])])[1] == ["ended without [DONE]"]


@pytest.mark.parametrize("tokens", [1, 2, 3, 10])
async def test_the_floor_streams_the_recorded_events(bench: Any, tokens: int) -> None:
    app = bench.floor.FloorApp(EVENTS, 0.0, 0.0)
    sent: list[dict[str, Any]] = []
    body = json.dumps({"max_tokens": tokens}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()
        raise AssertionError  # never: the response ends first

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "path": "/v1/chat/completions"}, receive, send)
    start, *bodies = sent
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream") in start["headers"]
    expected = EVENTS if tokens >= len(EVENTS) else [*EVENTS[: tokens - 1], EVENTS[-1]]
    assert [message["body"] for message in bodies] == [*expected, b"data: [DONE]\n\n"]
    assert [message["more_body"] for message in bodies] == [True] * len(expected) + [False]


def test_command_line(bench: Any) -> None:
    parse = bench.runner.build_parser().parse_args
    assert bench.runner.config_from_args(parse([])) == bench.runner.FULL
    quick = bench.runner.config_from_args(parse(["--quick", "--streams", "5", "50"]))
    assert quick.streams == (5, 50)
    assert quick.window == bench.runner.QUICK.window
    with pytest.raises(SystemExit):
        parse(["--quick", "--full"])
    with pytest.raises(SystemExit):
        parse(["--rate", "0"])


@pytest.mark.parametrize(
    ("floor_cpu_s", "verdict", "passed"),
    [(1.5, "not judged: a late server was saturated (1.00 cores)", True), (0.6, "MISSED", False)],
)
def test_late_streams_fail_the_run_unless_their_server_was_saturated(
    bench: Any, floor_cpu_s: float, verdict: str, passed: bool
) -> None:
    """A server at a full core could not carry the offered load: its streams still starting
    say so of the machine (the run is not judged), where one with headroom fails it."""

    def cell(server: str, cpu_s: float, late: int) -> Any:
        reading = bench.client.Reading(
            streams=1000, window_s=1.5, late_streams=late, chunks=4000, server_cpu_s=cpu_s
        )
        return bench.report.Cell(server, 1000, 0, reading)

    report = bench.report.ThroughputReport(
        config={},
        cells=[cell("serve", 0.9, 0), cell("floor", floor_cpu_s, 82)],
        intervals={1000: 0.2},
    )
    late = report.checks()[2]
    assert (late.measured, late.verdict) == ("82", verdict)
    assert report.passed is passed


# httpx, which records the events the floor streams, closes its stream from a finalizer
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_tiny_run(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = bench.runner.Config(
        streams=(3,), rate=300.0, max_tokens=4, rounds=1, warmup=0.3, window=0.6
    )
    steps = bench.runner.progress_steps(config)
    report = await bench.runner.run_benchmark(config, bench.output.Progress(steps, io.StringIO()))
    assert [(cell.server, cell.streams) for cell in report.cells] == [("serve", 3), ("floor", 3)]
    [row] = report.rows()
    for side in (row.serve, row.floor):
        assert side.chunks > 0
        assert side.failures == 0
        assert side.late_streams == 0
        assert side.tokens_per_chunk is not None
        assert side.tokens_per_chunk >= 1
    assert row.floor.tokens_per_chunk == 1  # the floor never coalesces: one event a token
    assert report.checks()[0].met
    assert report.checks()[1].met
    # The 100-stream targets need that row: not run here, never judged.
    assert [target.met for target in report.targets()[:2]] == [None, None]
    text = report.format()
    assert "serve/floor" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "## Serving throughput" in report.markdown()
    data = json.loads(json.dumps(report.to_json({"cpus": 2})))
    assert data["rows"][0]["streams"] == 3
    assert len(data["cells"]) == 2


@pytest.mark.sglang
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_tiny_run_beside_sglangs_own_server(bench: Any) -> None:
    """``--sglang``: SGLang's own server, on the stand-in scheduler, read as the others are;
    and ``--hosted`` (on the release whose application ``serve`` hosts): ``serve --engine
    sglang``'s way, over the same TokenizerManager and stand-in scheduler."""
    sglang = pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s sglang`")
    hosted = sglang.__version__ == bench.report.SGLANG_VERSION
    config = bench.runner.Config(
        streams=(3,),
        rate=300.0,
        max_tokens=4,
        rounds=1,
        warmup=0.5,
        window=0.6,
        sglang=True,
        hosted=hosted,
    )
    steps = bench.runner.progress_steps(config)
    report = await bench.runner.run_benchmark(config, bench.output.Progress(steps, io.StringIO()))
    [row] = report.rows()
    measured = [row.sglang, row.hosted] if hosted else [row.sglang]
    for side in measured:
        assert side is not None
        assert side.chunks > 0
        assert side.failures == 0
    text, ratios = report.format(), report.to_json({})["rows"][0]
    assert "SGLang 0.5.23's own HTTP server" in text
    assert ratios["ratio_sglang_over_floor"] is not None
    if hosted:
        assert "serve hosting SGLang's application" in text
        assert ratios["ratio_hosted_over_sglang"] is not None

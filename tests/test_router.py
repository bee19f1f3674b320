"""Two ``trio-sglang serve`` workers behind SGLang's routers: sglang-router and smg.

Every test runs behind each router of ``ROUTERS`` in turn: sglang-router
0.3.2 (``python -m sglang_router.launch_router``) and smg, its successor
(``smg launch``), which take the same options for what is used here.
Everything runs as real processes on loopback: two workers on the SimEngine
with a slow token interval, and the router with round robin in front of them.
Streams go through the router to the end, and clients that close mid-stream
must leave nothing live on either worker. Where the two routers differ, the
tests read the router's row of ``BEHAVIOURS``.

What sglang-router 0.3.x does with a worker (measured with a TCP tap):

- at registration: ``GET /health`` (HTTP/1.1) and, at the same time, gRPC
  health checks over HTTP/2 prior knowledge (SGLang's, then vLLM's scheduler
  service) to detect the connection mode; then ``GET /server_info`` (falling
  back to ``/get_server_info``) and ``GET /model_info`` (falling back to
  ``/get_model_info``) for metadata (404s there are tolerated, and the worker
  is then registered under the model id ``unknown``; ours answer, so the
  router lists the served model). Afterwards ``GET /health``
  every ``--health-check-interval-secs`` (60 s by default).
- it forwards ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``
  re-serialized through its own request types: it adds fields with their
  defaults (``model``, ``log_metrics``, ``return_entropy``, ... on
  ``/generate``; ``no_stop_trim``, ``ignore_eos``, ``skip_special_tokens``, ...
  on the OpenAI routes) and turns chat ``max_tokens`` into
  ``max_completion_tokens``.
- a client disconnect: the router sends no abort. Once it has answered (a
  stream's headers), it notices the disconnect only when it next writes to
  the client (when the worker's next chunk arrives), then drops its
  connection to the worker, and the worker cancels the request at once.
  Before it has answered (a non-streaming request; in PD mode, a stream
  whose prefill is still running) it notices at once. The worker's SSE
  heartbeats (``--sse-heartbeat``, 0.1 s) are such chunks: a streaming
  client that leaves before the first token, or in a long gap between two,
  is let go within about one heartbeat instead of at the next token.
- a non-streaming answer is buffered whole before the router sends any of it
  (with a ``content-length``), so bytes a worker sent early (leading
  whitespace) would never reach the client; measured with a stub worker, see
  docs/serving.md.

smg 1.13 registers a worker the same way, sends no abort either, and sees a
client's close at once, with or without a write; in PD mode it answers a
stream's headers at once and keeps the prefill leg's connection open when
the client leaves, which the prefill server's rooms make up for
(docs/serving.md, docs/disaggregation.md).

The heartbeat tests run clusters of their own (a 5 s first token, 2 s
between tokens, heartbeats off), and a prefill/decode pair behind the router
in PD mode; the measured times from a client leaving to the workers letting
go are printed (``-s``) and recorded as the tests' properties
(``record_property``, in a JUnit XML report).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import _router_cluster
from _processes import post_raw, wait_until
from _router_cluster import (
    CANCEL_BOUND,
    FIRST_TOKEN_DELAY,
    HEARTBEAT,
    HEARTBEAT_BOUND,
    LONG,
    MODEL,
    TIMEOUT,
    TOKEN_GAP,
    TOKEN_INTERVAL,
    Cluster,
    chat_body,
    completions_body,
    counts,
    data_events,
    deltas,
    first_token_then_heartbeat,
    generate_body,
    is_heartbeat,
    leave,
    let_go,
    live,
    nothing_received,
    open_streams,
    require_ok,
    running_cluster,
    sim_events,
    stream_to_the_end,
    until_heartbeat,
    wait_idle,
)

#: Each router in ROUTERS, the module's tests run behind each in turn.
router_name = _router_cluster.router_name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, router_name: str) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("router")
    args = ("--sim-token-interval", str(TOKEN_INTERVAL))
    with running_cluster(log_dir, router_name, *args) as started:
        yield started


@pytest.fixture(scope="module")
def waiting(tmp_path_factory: pytest.TempPathFactory, router_name: str) -> Iterator[Cluster]:
    """Heartbeats on (the default); the first token 5 s after a request reaches the engine."""
    args = ("--sim-first-token-delay", str(FIRST_TOKEN_DELAY))
    with running_cluster(tmp_path_factory.mktemp("waiting"), router_name, *args) as started:
        yield started


# -- tests -----------------------------------------------------------------------


def test_the_router_registers_both_workers_over_http(cluster: Cluster) -> None:
    listing = httpx.get(f"{cluster.router}/workers", timeout=TIMEOUT).json()
    registered = {w["url"]: w for w in listing["workers"]}
    assert set(registered) == set(cluster.workers)
    for worker in registered.values():
        assert worker["is_healthy"]
        assert worker["connection_mode"].lower() == "http"
    # The workers' /server_info names the model, so the router lists it.
    models = httpx.get(f"{cluster.router}/v1/models", timeout=TIMEOUT).json()
    assert MODEL in [m["id"] for m in models["data"]]
    cluster.require_workers_alive()


def test_streams_through_the_router_to_the_end(cluster: Cluster) -> None:
    wait_idle(cluster)
    completed = "trio_sglang_requests_total"
    before = counts(cluster, completed, outcome="completed")
    with httpx.Client(base_url=cluster.router, timeout=TIMEOUT) as client:
        for _ in range(2):  # round robin: one on each worker
            chunks = stream_to_the_end(client, "/generate", generate_body(3))
            assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
            (public_id,) = {c["meta_info"]["id"] for c in chunks}
            assert public_id.startswith("gen-")  # the worker's public id, untouched

        chunks = stream_to_the_end(client, "/v1/completions", completions_body(3))
        assert len(chunks) == 3
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}
        assert chunks[0]["id"].startswith("cmpl-")

        chunks = stream_to_the_end(client, "/v1/chat/completions", chat_body(3, stream=True))
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        # The router sends chat's max_tokens on as max_completion_tokens.
        response = client.post("/v1/chat/completions", json=chat_body(2, stream=False))
        require_ok(response)
        assert response.json()["usage"]["completion_tokens"] == 2

    gained = deltas(counts(cluster, completed, outcome="completed"), before)
    assert sum(gained) == 5
    assert all(n >= 1 for n in gained), f"requests did not reach both workers: {gained}"
    wait_idle(cluster)
    cluster.require_workers_alive()


def test_closing_clients_through_the_router_cancels_on_each_worker(cluster: Cluster) -> None:
    wait_idle(cluster)
    requests, cancellations = "trio_sglang_requests_total", "trio_sglang_cancellations_total"
    cancelled_before = counts(cluster, requests, outcome="cancelled")
    completed_before = counts(cluster, requests, outcome="completed")
    mid_stream_before = counts(cluster, cancellations, phase="mid_stream")

    bodies = [("/generate", generate_body(LONG)), ("/v1/completions", completions_body(LONG))] * 3
    with contextlib.ExitStack() as stack:
        streams = []
        for path, body in bodies:  # a client (so a connection) each
            client = stack.enter_context(httpx.Client(base_url=cluster.router, timeout=TIMEOUT))
            response = stack.enter_context(client.stream("POST", path, json=body))
            require_ok(response)
            streams.append((client, response, response.iter_lines()))
        for _, _, lines in streams:  # (kept: dropping an iterator would close its response)
            assert len(data_events(lines, count=2)) == 2  # two tokens in, 198 to go
        held = [live(worker) for worker in cluster.workers]
        assert sum(held) == len(bodies)
        assert all(n >= 1 for n in held), f"requests did not reach both workers: {held}"

        for client, response, _ in streams:
            response.close()
            client.close()
        took = wait_until(
            "both workers let go of every request",
            lambda: all(live(worker) == 0 for worker in cluster.workers),
            CANCEL_BOUND,
        )
    print(f"client close -> live 0 on both workers: {took:.3f} s (token interval {TOKEN_INTERVAL})")

    wait_until(
        "every request counted as cancelled",
        lambda: (
            sum(deltas(counts(cluster, requests, outcome="cancelled"), cancelled_before))
            == len(bodies)
        ),
        TIMEOUT,
    )
    assert deltas(counts(cluster, requests, outcome="completed"), completed_before) == [0, 0]
    mid_stream = deltas(counts(cluster, cancellations, phase="mid_stream"), mid_stream_before)
    assert sum(mid_stream) == len(bodies)
    assert all(n >= 1 for n in mid_stream)
    cluster.require_workers_alive()


def test_behind_the_router_a_client_gone_before_the_first_token_is_let_go_within_a_heartbeat(
    waiting: Cluster, record_property: Callable[[str, object], None]
) -> None:
    wait_idle(waiting)
    cancellations = "trio_sglang_cancellations_total"
    before_first_token = counts(waiting, cancellations, phase="before_first_token")
    tokens = sim_events(waiting, "token")

    bodies = [
        ("/generate", generate_body(LONG)),
        ("/v1/chat/completions", chat_body(LONG, stream=True)),
    ]
    with contextlib.ExitStack() as stack:
        streams = open_streams(stack, waiting.router, bodies)
        wait_until(
            "the workers hold both requests",
            lambda: sum(live(worker) for worker in waiting.workers) == 2,
            TIMEOUT,
        )
        for _, _, lines in streams:  # the router passes the worker's heartbeats on
            assert until_heartbeat(lines) == []  # and nothing else: no token yet
        left = leave(streams)
        took = let_go(waiting.workers, left, HEARTBEAT_BOUND, "both workers let go")
    print(
        f"client gone before the first token -> both workers let go: {took:.3f} s "
        f"(heartbeat {HEARTBEAT} s, first token due after {FIRST_TOKEN_DELAY} s)"
    )
    record_property("before_first_token_let_go_s", round(took, 3))

    # Let go before the first token: no token was decoded, and each worker
    # counted the disconnect in that phase.
    assert deltas(sim_events(waiting, "token"), tokens) == [0, 0]
    gained = deltas(counts(waiting, cancellations, phase="before_first_token"), before_first_token)
    assert sum(gained) == 2
    waiting.require_workers_alive()


def test_behind_the_router_a_non_streaming_client_that_leaves_is_let_go_at_once(
    waiting: Cluster, record_property: Callable[[str, object], None]
) -> None:
    """No heartbeat can reach a non-streaming client (the router buffers the answer), and none
    is needed: the router has not answered yet, so it notices the disconnect at once."""
    wait_idle(waiting)
    cancellations = "trio_sglang_cancellations_total"
    before = sum(counts(waiting, cancellations, phase="before_first_token"))
    body = {**generate_body(LONG), "stream": False}
    with contextlib.closing(post_raw(waiting.router, "/generate", body, TIMEOUT)) as sock:
        wait_until(
            "a worker holds the request",
            lambda: sum(live(worker) for worker in waiting.workers) == 1,
            TIMEOUT,
        )
        assert nothing_received(sock)
        left = time.monotonic()
    took = let_go(waiting.workers, left, HEARTBEAT_BOUND, "the worker let go")
    print(f"non-streaming client gone -> the worker let go: {took:.3f} s")
    record_property("non_streaming_let_go_s", round(took, 3))
    assert sum(counts(waiting, cancellations, phase="before_first_token")) == before + 1
    waiting.require_workers_alive()


@pytest.fixture
def slow_tokens(tmp_path: Path, router_name: str) -> Iterator[Cluster]:
    """Heartbeats on; the first token at once, then one every TOKEN_GAP seconds."""
    args = ("--sim-token-interval", str(TOKEN_GAP))
    with running_cluster(tmp_path, router_name, *args) as started:
        yield started


def test_behind_the_router_a_client_gone_in_a_long_gap_is_let_go_within_a_heartbeat(
    slow_tokens: Cluster, record_property: Callable[[str, object], None]
) -> None:
    cluster = slow_tokens
    cancellations = "trio_sglang_cancellations_total"
    bodies = [("/v1/completions", completions_body(LONG)), ("/generate", generate_body(LONG))]
    with contextlib.ExitStack() as stack:
        streams = open_streams(stack, cluster.router, bodies)
        for _, _, lines in streams:  # the first token, then silence but for heartbeats
            assert len(first_token_then_heartbeat(lines)) == 1
        left = leave(streams)
        took = let_go(cluster.workers, left, HEARTBEAT_BOUND, "both workers let go")
    print(
        f"client gone mid-stream -> both workers let go: {took:.3f} s "
        f"(heartbeat {HEARTBEAT} s, the next token due {TOKEN_GAP} s after the first)"
    )
    record_property("mid_stream_let_go_s", round(took, 3))

    assert sum(sim_events(cluster, "token")) == 2  # the second token never came
    assert sum(counts(cluster, cancellations, phase="mid_stream")) == 2
    cluster.require_workers_alive()


@pytest.fixture
def waiting_quiet(tmp_path: Path, router_name: str) -> Iterator[Cluster]:
    """``waiting`` with heartbeats off, and TOKEN_GAP between tokens."""
    args = ["--sim-first-token-delay", str(FIRST_TOKEN_DELAY), "--sse-heartbeat", "0"]
    args += ["--sim-token-interval", str(TOKEN_GAP)]
    with running_cluster(tmp_path, router_name, *args) as started:
        yield started


@pytest.mark.slow
def test_with_heartbeats_off_the_worker_is_let_go_when_the_router_sees_the_client_gone(
    waiting_quiet: Cluster, record_property: Callable[[str, object], None]
) -> None:
    """With ``--sse-heartbeat 0`` nothing is written to a client before its first token. A
    router that notices a close only when it writes (sglang-router) holds the request until
    then; one that sees the close itself (smg) lets it go at once."""
    cluster = waiting_quiet
    bodies = [("/generate", generate_body(LONG)), ("/v1/completions", completions_body(LONG))]
    with contextlib.ExitStack() as stack:
        sent = time.monotonic()
        streams = open_streams(stack, cluster.router, bodies)
        wait_until(
            "the workers hold both requests",
            lambda: sum(live(worker) for worker in cluster.workers) == 2,
            TIMEOUT,
        )
        left = leave(streams)
        took = let_go(cluster.workers, left, FIRST_TOKEN_DELAY + TIMEOUT, "both workers let go")
    held = left + took - sent
    print(
        f"heartbeats off: client gone before the first token -> both workers let go: "
        f"{took:.3f} s after it left, {held:.3f} s after the request"
    )
    record_property("heartbeats_off_let_go_s", round(took, 3))

    cancellations = "trio_sglang_cancellations_total"
    if cluster.behaviour.sees_a_close_at_once:
        assert took <= HEARTBEAT_BOUND
        assert sim_events(cluster, "token") == [0, 0]
        assert sum(counts(cluster, cancellations, phase="before_first_token")) == 2
    else:
        # Held until the first token, which the router then failed to deliver: each
        # engine decoded it (the second was TOKEN_GAP later), and the worker saw
        # the disconnect after its first event, so mid-stream.
        assert held >= FIRST_TOKEN_DELAY
        assert sum(sim_events(cluster, "token")) == 2
        assert sum(counts(cluster, cancellations, phase="mid_stream")) == 2
        assert counts(cluster, cancellations, phase="before_first_token") == [0, 0]
    cluster.require_workers_alive()


# -- what clients see: the same chunks, heartbeats or not -----------------------------------

#: Heartbeats before the first token (0.35 s) and in every gap (0.3 s); a 4-token
#: answer takes 1.25 s.
PACED = ("--sim-first-token-delay", "0.35", "--sim-token-interval", "0.3")


@pytest.fixture
def paced(tmp_path_factory: pytest.TempPathFactory, router_name: str) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("paced"), router_name, *PACED) as started:
        yield started


@pytest.fixture
def paced_quiet(tmp_path_factory: pytest.TempPathFactory, router_name: str) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("paced-quiet")
    with running_cluster(log_dir, router_name, *PACED, "--sse-heartbeat", "0") as started:
        yield started


#: What differs between two runs of one request: its id and its creation time.
VOLATILE = frozenset({"id", "created"})


def steady(value: Any) -> Any:
    """``value`` without its VOLATILE fields, at any depth."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [steady(v) for v in value]
    return value


def httpx_session(url: str, path: str, body: dict[str, Any]) -> tuple[list[Any], int]:
    """The stream's data payloads, parsed (``[DONE]`` kept), and how many of them came after
    a silence with a heartbeat in it."""
    events: list[Any] = []
    after_heartbeat, heard = 0, False
    with (
        httpx.Client(base_url=url, timeout=TIMEOUT) as client,
        client.stream("POST", path, json=body) as response,
    ):
        require_ok(response)
        previous = None
        for line in response.iter_lines():
            heard = heard or is_heartbeat(line, previous)
            previous = line
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else steady(json.loads(data)))
                after_heartbeat, heard = after_heartbeat + heard, False
    assert events[-1] == "[DONE]", events
    return events, after_heartbeat


def sdk_session(url: str, route: str) -> tuple[list[Any], int]:
    """The openai SDK's parsed chunks of a stream (it hides SSE comments, so none counted)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    with client:
        if route == "chat":
            messages: list[Any] = [{"role": "user", "content": "Hello"}]
            chat = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True
            )
            chunks = [steady(chunk.model_dump()) for chunk in chat]
        else:
            stream = client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=4, stream=True
            )
            chunks = [steady(chunk.model_dump()) for chunk in stream]
    return chunks, 0


SESSIONS: dict[str, Callable[[str], tuple[list[Any], int]]] = {
    "httpx /generate": lambda url: httpx_session(url, "/generate", generate_body(4)),
    "httpx chat": lambda url: httpx_session(url, "/v1/chat/completions", chat_body(4, stream=True)),
    "sdk chat": lambda url: sdk_session(url, "chat"),
    "sdk completions": lambda url: sdk_session(url, "completions"),
}


def test_clients_see_the_same_chunks_with_heartbeats_on_and_off(
    paced: Cluster, paced_quiet: Cluster
) -> None:
    """One deterministic request per client and route, to a worker directly and through the
    router, with heartbeats on and off: the parsed chunks are equal; only the raw streams
    with heartbeats on carry comments (before the first token and in every gap)."""
    targets = {
        ("on", "direct"): paced.workers[0],
        ("on", "router"): paced.router,
        ("off", "direct"): paced_quiet.workers[0],
        ("off", "router"): paced_quiet.router,
    }
    jobs = [(target, name) for target in targets for name in SESSIONS]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {job: pool.submit(SESSIONS[job[1]], targets[job[0]]) for job in jobs}
        results = {job: future.result(timeout=TIMEOUT) for job, future in futures.items()}

    for way in ("direct", "router"):
        for name in SESSIONS:
            on, heard_on = results[("on", way), name]
            off, heard_off = results[("off", way), name]
            assert on == off, f"{name}, {way}"
            assert len(on) >= 4, on  # at least a chunk per token
            if name.startswith("httpx"):
                # 0.35 s before the first token and 0.3 s before each of the other
                # three: a heartbeat in each of those four silences, none when off.
                assert heard_on >= 4, f"{name}, {way}: {on}"
                assert heard_off == 0, f"{name}, {way}"
    for name in SESSIONS:  # and the router changes nothing either
        assert results[("on", "router"), name] == results[("on", "direct"), name], name
    paced.require_workers_alive()
    paced_quiet.require_workers_alive()


# -- benchmarks/router_cancel.py ---------------------------------------------------------------


@pytest.mark.slow
def test_the_router_cancel_benchmark_runs_and_prints_its_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny run of the benchmark (a client a cell, 0.5 s waits): nothing is leaked or fails,
    the table has its four rows; no timing is asserted."""
    import router_cancel

    args = ["--repeat", "1", "--first-token-delay", "0.5", "--token-gap", "0.5"]
    assert router_cancel.main(args) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line for line in table if line.startswith("heartbeats")]
    assert [row.split("  ")[0] for row in rows] == [
        "heartbeats 0.1 s, router",
        "heartbeats 0.1 s, direct",
        "heartbeats off, router",
        "heartbeats off, direct",
    ]
    assert not any(word in row for row in rows for word in ("leaked", "failed")), rows

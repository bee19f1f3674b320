"""Two ``trio-sglang serve`` workers behind SGLang's own router (the ``sglang-router`` package).

Everything runs as real processes on loopback: two workers on the SimEngine
with a slow token interval, and ``python -m sglang_router.launch_router``
with round robin in front of them. Streams go through the router to the end,
and clients that close mid-stream must leave nothing live on either worker.

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
- a client disconnect: the router sends no abort; it notices the disconnect
  only when it next writes to the client (when the worker's next chunk
  arrives), then drops its connection to the worker, and the worker cancels
  the request at once. So the worker lets go within about one token interval.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from prometheus_client import parser

if importlib.util.find_spec("sglang_router") is None:
    pytest.skip(
        "sglang-router is not installed (pip install sglang-router): "
        "the multi-worker tests need SGLang's router",
        allow_module_level=True,
    )

from _processes import Process, start_router, start_workers

#: The SimEngine's seconds per decoded token on both workers: slow, so streams stay open.
TOKEN_INTERVAL = 0.2
#: A request the workers would need 200 * 0.2 = 40 s to finish on their own.
LONG = 200
#: Generous bound for "the worker let go": far below the 40 s natural run.
CANCEL_BOUND = 10.0
TIMEOUT = 10.0
MODEL = "trio-sglang-sim"


@dataclass
class Cluster:
    router: str
    workers: list[str]
    worker_processes: list[Process]
    router_process: Process

    def require_workers_alive(self) -> None:
        for process in self.worker_processes:
            if not process.alive():
                _worker_died(process)


def _worker_died(process: Process) -> NoReturn:
    raise AssertionError(f"{process.name} died\n{process.tail()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir: Path = tmp_path_factory.mktemp("router")
    started: list[Process] = []
    try:
        pairs = start_workers(
            ["worker-a", "worker-b"], log_dir, "--sim-token-interval", str(TOKEN_INTERVAL)
        )
        worker_processes = [process for process, _ in pairs]
        workers = [url for _, url in pairs]
        started += worker_processes
        try:
            router, router_url = start_router(
                log_dir,
                workers,
                "--policy", "round_robin",
                "--log-level", "warn",
                "--shutdown-grace-period-secs", "1",
                timeout=30,
                watched=worker_processes,
            )  # fmt: skip
        except AssertionError:
            for process in worker_processes:
                if not process.alive():
                    _worker_died(process)
            raise
        started.append(router)
        cluster = Cluster(router_url, workers, worker_processes, router)
        cluster.require_workers_alive()
        yield cluster
    finally:
        for process in reversed(started):  # the router first, then the workers
            process.stop()


# -- helpers -------------------------------------------------------------------


def scrape(worker: str) -> list[Any]:
    text = httpx.get(f"{worker}/metrics", timeout=TIMEOUT).text
    return [s for family in parser.text_string_to_metric_families(text) for s in family.samples]


def metric(samples: list[Any], name: str, **labels: str) -> float:
    return float(
        sum(
            s.value
            for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


def live(worker: str) -> int:
    return int(metric(scrape(worker), "trio_sglang_engine_live_requests"))


def wait_for(what: str, condition: Callable[[], bool], timeout: float) -> float:
    """Poll ``condition`` until true; the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def wait_idle(cluster: Cluster) -> None:
    wait_for(
        "both workers hold nothing", lambda: all(live(w) == 0 for w in cluster.workers), TIMEOUT
    )


def require_ok(response: httpx.Response) -> None:
    if response.status_code != 200:
        response.read()
        raise AssertionError(f"{response.status_code}: {response.text}")


def generate_body(tokens: int) -> dict[str, Any]:
    return {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": tokens}}


def completions_body(tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": tokens, "stream": True}


def chat_body(tokens: int, *, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": MODEL, "messages": messages, "max_tokens": tokens, "stream": stream}


def data_events(lines: Iterator[str], count: int | None = None) -> list[str]:
    """SSE payloads up to ``[DONE]`` (included), or the first ``count`` of them."""
    events: list[str] = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
            if events[-1] == "[DONE]" or len(events) == count:
                break
    return events


def stream_to_the_end(
    client: httpx.Client, path: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    with client.stream("POST", path, json=body) as response:
        require_ok(response)
        assert response.headers["content-type"].startswith("text/event-stream")
        events = data_events(response.iter_lines())
    assert events[-1] == "[DONE]", events
    return [json.loads(event) for event in events[:-1]]


def counts(cluster: Cluster, name: str, **labels: str) -> list[float]:
    return [metric(scrape(worker), name, **labels) for worker in cluster.workers]


def deltas(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


# -- tests -----------------------------------------------------------------------


def test_the_router_registers_both_workers_over_http(cluster: Cluster) -> None:
    listing = httpx.get(f"{cluster.router}/workers", timeout=TIMEOUT).json()
    registered = {w["url"]: w for w in listing["workers"]}
    assert set(registered) == set(cluster.workers)
    for worker in registered.values():
        assert worker["is_healthy"]
        assert worker["connection_mode"] == "HTTP"
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
        took = wait_for(
            "both workers let go of every request",
            lambda: all(live(worker) == 0 for worker in cluster.workers),
            CANCEL_BOUND,
        )
    print(f"client close -> live 0 on both workers: {took:.3f} s (token interval {TOKEN_INTERVAL})")

    wait_for(
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

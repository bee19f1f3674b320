"""Two ``trio-sglang serve`` workers behind a router, and what the router tests read of them.

The clusters (``running_cluster``), each router's measured ``Behaviour``, the
workers' metrics, the clients that stream or leave, and the SSE heartbeat
reader. The tests are ``test_router.py`` (streams, leaving clients and
heartbeats) and ``test_router_pd.py`` (a prefill/decode pair in the router's
PD mode).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
import pytest
from prometheus_client import parser

from _processes import ROUTERS, Process, answer_json, start_router, start_workers, wait_until

#: The SimEngine's seconds per decoded token on both workers: slow, so streams stay open.
TOKEN_INTERVAL = 0.2
#: A request the workers would need 200 * 0.2 = 40 s to finish on their own.
LONG = 200
#: Generous bound for "the worker let go": far below the 40 s natural run.
CANCEL_BOUND = 10.0
TIMEOUT = 10.0
MODEL = "trio-sglang-sim"

#: ``--sse-heartbeat``'s default, which the heartbeat tests' workers run with.
HEARTBEAT = 0.1
#: "Let go within a heartbeat": the interval, plus room for a busy 2-core machine
#: (the polls of both workers' /metrics included). Measured: about 0.1 s.
HEARTBEAT_BOUND = 1.0
#: The waiting clusters' first token: what a client that left before it cost
#: the worker without heartbeats (the issue's 5 s).
FIRST_TOKEN_DELAY = 5.0
#: The slow clusters' seconds between two tokens.
TOKEN_GAP = 2.0


@dataclass(frozen=True)
class Behaviour:
    """What a router does when its client leaves, as this module's tests measure it."""

    #: It notices a client's closed connection at once, with nothing to write to it;
    #: otherwise only at its next write (a token, or one of the worker's SSE heartbeats).
    sees_a_close_at_once: bool
    #: In PD mode it answers a stream's headers before the prefill leg ends, and keeps the
    #: prefill leg's connection open after its client left (the leg runs on, for nobody).
    keeps_the_prefill_leg: bool


BEHAVIOURS = {
    "sglang-router": Behaviour(sees_a_close_at_once=False, keeps_the_prefill_leg=False),
    "smg": Behaviour(sees_a_close_at_once=True, keeps_the_prefill_leg=True),
}


@pytest.fixture(scope="module", params=list(ROUTERS))
def router_name(request: pytest.FixtureRequest) -> str:
    """Each router in ROUTERS, the module's tests run behind each in turn."""
    name: str = request.param
    module = ROUTERS[name][0].split(".")[0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{name} is not installed (pip install 'trio-sglang[router]')")
    return name


@dataclass
class Cluster:
    router: str
    workers: list[str]
    worker_processes: list[Process]
    router_process: Process
    behaviour: Behaviour

    def require_workers_alive(self) -> None:
        for process in self.worker_processes:
            if not process.alive():
                _worker_died(process)


def _worker_died(process: Process) -> NoReturn:
    raise AssertionError(f"{process.name} died\n{process.tail()}")


@contextlib.contextmanager
def running_cluster(log_dir: Path, router_name: str, *worker_args: str) -> Iterator[Cluster]:
    """Two workers started with ``worker_args`` behind a round-robin ``router_name``;
    stopped after."""
    started: list[Process] = []
    try:
        pairs = start_workers(["worker-a", "worker-b"], log_dir, *worker_args)
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
                router=router_name,
            )  # fmt: skip
        except AssertionError:
            for process in worker_processes:
                if not process.alive():
                    _worker_died(process)
            raise
        started.append(router)
        behaviour = BEHAVIOURS[router_name]
        cluster = Cluster(router_url, workers, worker_processes, router, behaviour)
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


def wait_idle(cluster: Cluster) -> None:
    wait_until(
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


# -- SSE heartbeats: a client gone while its stream is silent ---------------------------
#
# Once the router has answered a stream (the worker sends its headers at once),
# it notices a gone client only when it next writes to it. Without heartbeats
# that is the first token (FIRST_TOKEN_DELAY after the request reached the
# engine) or the next one (TOKEN_GAP later); with them, the next heartbeat.


def sim_events(cluster: Cluster, kind: str) -> list[float]:
    """Each worker's SimEngine events of ``kind`` so far (``token``, ``abort_applied``, ...)."""
    return counts(cluster, "trio_sglang_sim_events_total", kind=kind)


def is_heartbeat(line: str, previous: str | None) -> bool:
    """A heartbeat is blank lines: a blank line that no data line ends (one after a blank
    line, or the stream's first). An event ends with one blank line of its own."""
    return line == "" and previous in ("", None)


def until_heartbeat(lines: Iterator[str]) -> list[str]:
    """Read up to the next heartbeat; the data payloads read before it."""
    events: list[str] = []
    previous = None
    for line in lines:
        if is_heartbeat(line, previous):
            return events
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
        previous = line
    raise AssertionError(f"the stream ended without a heartbeat: {events}")


def first_token_then_heartbeat(lines: Iterator[str]) -> list[str]:
    """Read up to the first data event, then up to the next heartbeat; the data payloads read."""
    for line in lines:
        if line.startswith("data: "):
            return [line.removeprefix("data: "), *until_heartbeat(lines)]
    raise AssertionError("the stream ended without a data event")


Stream = tuple[httpx.Client, httpx.Response, Iterator[str]]


def open_streams(
    stack: contextlib.ExitStack, url: str, bodies: list[tuple[str, dict[str, Any]]]
) -> list[Stream]:
    """A client (so a connection) per body, each with its response's headers in."""
    streams = []
    for path, body in bodies:
        client = stack.enter_context(httpx.Client(base_url=url, timeout=TIMEOUT))
        response = stack.enter_context(client.stream("POST", path, json=body))
        require_ok(response)
        streams.append((client, response, response.iter_lines()))
    return streams


def leave(streams: list[Stream]) -> float:
    """Close every stream's connection; when the first one went (``time.monotonic``)."""
    left = time.monotonic()
    for client, response, _ in streams:
        response.close()
        client.close()
    return left


def let_go(workers: list[str], left: float, bound: float, what: str) -> float:
    """Poll until no worker holds a request, at most ``bound`` s; the seconds since ``left``."""
    wait_until(what, lambda: all(live(worker) == 0 for worker in workers), bound)
    return time.monotonic() - left


def nothing_received(sock: socket.socket) -> bool:
    """Whether no byte of an answer has reached ``sock`` yet."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)  # a byte, or b"" if the connection was closed
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(TIMEOUT)
    return False


def pd_registered(router: str, roles: dict[str, str]) -> bool:
    """Whether the router lists each URL as a healthy worker of its role."""
    listing = answer_json(f"{router}/workers")
    workers = listing.get("workers", []) if isinstance(listing, dict) else []
    healthy = {w["url"]: w["worker_type"] for w in workers if w.get("is_healthy")}
    return all(healthy.get(url) == role for url, role in roles.items())

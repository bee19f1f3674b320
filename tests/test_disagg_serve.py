"""A prefill and a decode ``trio-sglang serve`` over loopback, paired as SGLang pairs them.

The prefill server hosts its KV rooms on its HTTP port (SGLang's bootstrap
server); the decode server's SimEngine reaches them there, at the
``bootstrap_host:bootstrap_port`` each request carries. Two ways in:

- the decode server alone (``--prefill-url``): it runs each request's
  prefill leg at the prefill server (a non-streaming ``/generate``) beside
  its own decode leg, and a client that leaves cancels both: the decode leg
  in the decode server, the prefill leg by closing its connection;
- sglang-router in PD mode (``--pd-disaggregation``): it sends one body to
  both servers with the bootstrap fields filled in. It sends no abort when
  its client leaves; it drops its connections to both servers, which our
  servers take as a cancel.

Everything runs as real processes. The prefill is slow (0.05 s per prompt
token, chunks of 4, so a 40-word prompt takes 10 forwards and 2 s), the
decode side's handshake takes 1 s and its tokens 0.2 s, so each phase lasts
long enough to leave in. A test waits (bounded polls of ``/metrics``) until
the request is in the phase it wants, leaves, then judges from both
servers' ``/metrics``: nothing live, no room left, and what the prefill's
SimEngine did (``trio_sglang_sim_events_total``): aborted, not finished.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import parser

from _processes import (
    Process,
    free_port,
    free_ports,
    healthy,
    start_router,
    start_workers,
    wait_until,
)
from _readme import readme_block
from _router_cluster import pd_registered
from test_serve_cli import serve_exits

PREFILL_ARGS = (
    "--disaggregation-mode", "prefill",
    "--sim-prefill-time-per-token", "0.05",
    "--sim-prefill-chunk-tokens", "4",
)  # fmt: skip
DECODE_ARGS = (
    "--disaggregation-mode", "decode",
    "--sim-bootstrap-delay", "1.0",
    "--sim-token-interval", "0.2",
)  # fmt: skip
#: 40 prompt tokens: 10 prefill forwards of 0.2 s.
LONG_PROMPT = " ".join(["word"] * 40)
FORWARDS = 10
#: Far beyond what any step here needs, far below SGLang's 300 s KV timeout.
TIMEOUT = 15.0
MODEL = "trio-sglang-sim"
ROUTER = importlib.util.find_spec("sglang_router") is not None


@dataclass
class Server:
    url: str
    process: Process


@dataclass
class Pair:
    prefill: Server
    decode: Server


@dataclass
class Routed:
    pair: Pair
    url: str


def _start(log_dir: Path, name: str, *args: str) -> Server:
    ((process, url),) = start_workers([name], log_dir, *args)
    return Server(url, process)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disagg")


@pytest.fixture(scope="module")
def prefill(log_dir: Path) -> Iterator[Server]:
    server = _start(log_dir, "prefill", *PREFILL_ARGS)
    try:
        yield server
    finally:
        server.process.stop()


@pytest.fixture(scope="module")
def pair(log_dir: Path, prefill: Server) -> Iterator[Pair]:
    decode = _start(log_dir, "decode", *DECODE_ARGS, "--prefill-url", prefill.url)
    try:
        yield Pair(prefill, decode)
    finally:
        decode.process.stop()


@pytest.fixture(scope="module")
def lone_decode(log_dir: Path) -> Iterator[Server]:
    """A decode server without a prefill peer: it takes requests with bootstrap fields only.

    Those may name any prefill server on loopback (the router's, at whatever port).
    """
    decode = _start(log_dir, "lone-decode", *DECODE_ARGS, "--allowed-bootstrap-hosts", "127.0.0.1")
    try:
        yield decode
    finally:
        decode.process.stop()


@pytest.fixture(scope="module")
def routed(log_dir: Path, prefill: Server, lone_decode: Server) -> Iterator[Routed]:
    """sglang-router in PD mode before the prefill server and the lone decode server."""
    if not ROUTER:
        pytest.skip("sglang-router is not installed (pip install sglang-router)")
    port = prefill.url.rsplit(":", 1)[1]
    pd = ["--pd-disaggregation", "--prefill", prefill.url, port, "--decode", lone_decode.url]
    watched = [prefill.process, lone_decode.process]
    router, url = start_router(log_dir, [], *pd, "--log-level", "warn", watched=watched)
    try:
        roles = {prefill.url: "prefill", lone_decode.url: "decode"}
        wait_until(
            "the router to register both sides",
            lambda: pd_registered(url, roles),
            TIMEOUT,
            router,
            *watched,
        )
        yield Routed(Pair(prefill, lone_decode), url)
    finally:
        router.stop()


# -- metrics ---------------------------------------------------------------------


class Metrics:
    """One scrape of a server's ``/metrics``: every sample, by name and labels."""

    def __init__(self, text: str) -> None:
        self._samples = [
            sample
            for family in parser.text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in self._samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def event(self, kind: str) -> float:
        return self.value("trio_sglang_sim_events_total", kind=kind)

    @property
    def live(self) -> float:
        return self.value("trio_sglang_engine_live_requests")

    @property
    def rooms(self) -> float:
        return self.value("trio_sglang_kv_rooms")


async def scrape(server: Server) -> Metrics:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        response = await client.get(f"{server.url}/metrics")
    return Metrics(response.text)


class Gains:
    """What a server's counters gained since the test started."""

    def __init__(self, server: Server, before: Metrics) -> None:
        self.server = server
        self.before = before
        self.after = before

    @classmethod
    async def start(cls, server: Server) -> Gains:
        return cls(server, await scrape(server))

    async def update(self) -> Gains:
        self.after = await scrape(self.server)
        return self

    def event(self, kind: str) -> float:
        return self.after.event(kind) - self.before.event(kind)

    def value(self, name: str, **labels: str) -> float:
        return self.after.value(name, **labels) - self.before.value(name, **labels)


async def wait_for(what: str, condition: Callable[[], Awaitable[bool]]) -> float:
    """Poll ``condition`` (bounded) until it holds; the seconds it took."""
    start = trio.current_time()
    with trio.move_on_after(TIMEOUT):
        while True:  # polled: another process's state, which no event announces here
            if await condition():
                return trio.current_time() - start
            await trio.sleep(0.02)
    raise AssertionError(f"not within {TIMEOUT} s: {what}")


async def wait_idle(pair: Pair) -> float:
    """Until neither server holds a request nor the prefill server a room."""

    async def idle() -> bool:
        prefill, decode = await scrape(pair.prefill), await scrape(pair.decode)
        return prefill.live == decode.live == prefill.rooms == 0

    return await wait_for("both servers idle, no room left", idle)


# -- clients ---------------------------------------------------------------------


def generate(prompt: str, tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {"text": prompt, "stream": stream, "sampling_params": {"max_new_tokens": tokens}}


async def stream(url: str, path: str, body: dict[str, Any], events: list[Any]) -> None:
    """POST and collect the SSE payloads into ``events``; cancelling it closes the connection."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client,
        client.stream("POST", path, json=body) as response,
    ):
        if response.status_code != 200:
            await response.aread()
            raise AssertionError(f"{response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))


async def leave_when(
    url: str, body: dict[str, Any], what: str, condition: Callable[[], Awaitable[bool]]
) -> list[Any]:
    """Stream ``body`` from ``url`` and leave as soon as ``condition`` holds; the events seen."""
    events: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, url, "/generate", body, events)
        await wait_for(what, condition)
        nursery.cancel_scope.cancel()
    return events


@dataclass
class Watch:
    """Both servers' counters since the test started."""

    prefill: Gains
    decode: Gains

    @classmethod
    async def start(cls, pair: Pair) -> Watch:
        await wait_idle(pair)
        return cls(await Gains.start(pair.prefill), await Gains.start(pair.decode))

    async def update(self) -> Watch:
        await self.prefill.update()
        await self.decode.update()
        return self

    def prefill_stops(self) -> float:
        return self.prefill.event("abort_applied") + self.prefill.event("kv_failed")

    def assert_prefill_aborted(self) -> None:
        """The prefill's SimEngine stopped the leg before its KV cache went out."""
        assert self.prefill_stops() == 1
        assert self.prefill.event("kv_sent") == self.prefill.event("finished") == 0
        assert self.decode.event("kv_timeout") == 0
        assert self.decode.event("token") == 0


async def phase_reached(watch: Watch, prefill_event: str) -> bool:
    """Both sides hold the request (dispatched), and the prefill side got to ``prefill_event``."""
    await watch.update()
    return watch.decode.event("dispatched") == 1 and watch.prefill.event(prefill_event) >= 1


# -- the decode server with its own prefill peer ----------------------------------


async def test_complete_requests_run_both_legs(pair: Pair) -> None:
    watch = await Watch.start(pair)
    results: dict[str, list[Any]] = {"generate": [], "chat": []}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 3,
        "stream": True,
    }
    url = pair.decode.url
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, url, "/generate", generate("Hello", 3), results["generate"])
        nursery.start_soon(stream, url, "/v1/chat/completions", chat, results["chat"])
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            whole = await client.post("/generate", json=generate(LONG_PROMPT, 2, stream=False))
    assert whole.status_code == 200, whole.text
    assert whole.json()["meta_info"]["completion_tokens"] == 2

    *chunks, done = results["generate"]
    assert done == "[DONE]"
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert results["chat"][-1] == "[DONE]"
    assert results["chat"][-2]["choices"][0]["finish_reason"] == "length"

    await wait_idle(pair)
    await watch.update()
    assert watch.prefill.event("kv_sent") == watch.prefill.event("finished") == 3
    assert watch.prefill.event("prefill_chunk") >= 1 + 1 + FORWARDS  # Hello, chat, long
    assert watch.prefill_stops() == 0
    assert watch.decode.event("kv_received") == watch.decode.event("finished") == 3
    assert watch.decode.event("token") == 3 + 3 + 2


# Where the prefill leg is when the client leaves, before the first token: the
# prefill server's event that says it got there, and then what it must not do.
BEFORE_FIRST_TOKEN = {
    # Waiting for the decode side's handshake (1 s): never bootstrapped.
    "bootstrapping": ("dispatched", "bootstrapped"),
    # Computing its 10 forwards: stops after the one in progress.
    "prefilling": ("prefill_chunk", "kv_sent"),
}


@pytest.mark.parametrize("phase", BEFORE_FIRST_TOKEN, ids=BEFORE_FIRST_TOKEN.keys())
async def test_a_client_gone_before_the_first_token_aborts_the_prefill(
    pair: Pair, phase: str
) -> None:
    reached, never = BEFORE_FIRST_TOKEN[phase]
    watch = await Watch.start(pair)
    events = await leave_when(
        pair.decode.url,
        generate(LONG_PROMPT, 50),
        f"the prefill leg {phase}",
        lambda: phase_reached(watch, reached),
    )
    assert events == []
    took = await wait_idle(pair)
    print(f"client gone while {phase} -> both servers idle: {took:.3f} s")

    await watch.update()
    watch.assert_prefill_aborted()
    assert watch.prefill.event(never) == 0
    assert watch.prefill.event("prefill_chunk") < FORWARDS
    # The decode server cancelled its request, and the prefill leg's closed
    # connection cancelled the prefill server's.
    assert watch.decode.event("abort_applied") == 1
    for gains in (watch.prefill, watch.decode):
        assert gains.value("trio_sglang_requests_total", outcome="cancelled") == 1
        assert gains.value("trio_sglang_requests_total", outcome="completed") == 0


async def test_a_client_gone_mid_stream_stops_the_decode(pair: Pair) -> None:
    watch = await Watch.start(pair)

    async def two_tokens() -> bool:
        return len(events) >= 2

    events: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, pair.decode.url, "/generate", generate("Hello", 200), events)
        await wait_for("two tokens", two_tokens)
        nursery.cancel_scope.cancel()
    took = await wait_idle(pair)
    print(f"client gone mid-stream -> both servers idle: {took:.3f} s")

    await watch.update()
    # The prefill leg was over: it finished, and nothing was aborted there.
    assert watch.prefill.event("finished") == 1
    assert watch.prefill_stops() == 0
    assert watch.decode.event("abort_applied") == 1
    assert watch.decode.event("token") < 10
    assert watch.decode.value("trio_sglang_cancellations_total", phase="mid_stream") == 1


async def test_a_decode_server_alone_takes_only_requests_with_bootstrap_fields(
    lone_decode: Server,
) -> None:
    async with httpx.AsyncClient(base_url=lone_decode.url, timeout=TIMEOUT) as client:
        response = await client.post("/generate", json=generate("Hello", 2, stream=False))
    assert response.status_code == 400
    assert "bootstrap_room" in response.json()["error"]["message"]


# -- behind sglang-router in PD mode -----------------------------------------------


async def test_through_the_router_requests_complete(routed: Routed) -> None:
    watch = await Watch.start(routed.pair)
    events: list[Any] = []
    await stream(routed.url, "/generate", generate(LONG_PROMPT, 3), events)
    *chunks, done = events
    assert done == "[DONE]"
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    await wait_idle(routed.pair)
    await watch.update()
    assert watch.prefill.event("kv_sent") == watch.prefill.event("finished") == 1
    assert watch.decode.event("kv_received") == watch.decode.event("finished") == 1
    assert watch.prefill_stops() == 0


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_through_the_router_the_openai_routes_complete(routed: Routed, endpoint: str) -> None:
    # The router adds its bootstrap fields to OpenAI bodies too.
    watch = await Watch.start(routed.pair)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": True}
    if endpoint == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    events: list[Any] = []
    await stream(routed.url, endpoint, body, events)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    await wait_idle(routed.pair)
    await watch.update()
    assert watch.prefill.event("kv_sent") == watch.decode.event("kv_received") == 1


async def test_through_the_router_a_client_gone_during_the_prefill_aborts_both_legs(
    routed: Routed,
) -> None:
    # The router answers nothing before the prefill server has: the client
    # leaves while its request is being prefilled, before any header.
    watch = await Watch.start(routed.pair)
    events = await leave_when(
        routed.url,
        generate(LONG_PROMPT, 50),
        "the prefill leg prefilling",
        lambda: phase_reached(watch, "prefill_chunk"),
    )
    assert events == []
    took = await wait_idle(routed.pair)
    print(f"client gone before the router answered -> both servers idle: {took:.3f} s")
    await watch.update()
    watch.assert_prefill_aborted()
    assert watch.prefill.event("prefill_chunk") < FORWARDS
    assert watch.decode.event("abort_applied") == 1


async def test_through_the_router_a_client_gone_mid_stream_stops_the_decode(
    routed: Routed,
) -> None:
    watch = await Watch.start(routed.pair)

    async def two_tokens() -> bool:
        return len(events) >= 2

    events: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream, routed.url, "/generate", generate("Hello", 200), events)
        await wait_for("two tokens", two_tokens)
        nursery.cancel_scope.cancel()
    # The router notices at its next write to the client: about a token later.
    took = await wait_idle(routed.pair)
    print(f"client gone mid-stream behind the router -> both servers idle: {took:.3f} s")
    await watch.update()
    assert watch.prefill.event("finished") == 1
    assert watch.decode.event("abort_applied") == 1
    assert watch.decode.event("token") < 10


# -- docs/disaggregation.md, as written ---------------------------------------------


def readme_commands(containing: str, ports: dict[int, int]) -> list[list[str]]:
    """The commands of a docs ``sh`` block, each on a free port instead of the page's."""
    block = readme_block("sh", containing, "docs/disaggregation.md").replace("\\\n", " ")
    # One pass, so that a free port is never taken for a port of the page.
    named = "|".join(str(port) for port in ports)
    block = re.sub(rf"\b({named})\b", lambda m: str(ports[int(m[1])]), block)
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "trio-sglang":
            words = [sys.executable, "-m", "trio_sglang", *words[1:]]
        elif words and words[0] == "python":
            words = [sys.executable, *words[1:]]
        if words:
            commands.append(words)
    return commands


def run_curl(command: list[str]) -> list[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=True)
    return [line for line in result.stdout.splitlines() if line.startswith("data: ")]


def test_the_disaggregation_page_pair_commands_work_as_written(tmp_path: Path) -> None:
    ports = dict(zip((8100, 8200), free_ports(2), strict=True))
    *serves, curl = readme_commands("--prefill-url http://127.0.0.1:8100", ports)
    assert [c[3:5] for c in serves] == [["serve", "--disaggregation-mode"]] * 2
    started = []
    try:
        for i, command in enumerate(serves):
            started.append(Process(f"readme-{i}", command, tmp_path / f"readme-{i}.log"))
            url = f"http://127.0.0.1:{ports[(8100, 8200)[i]]}"
            wait_until(f"{url} up", partial(healthy, url), TIMEOUT, *started)
        events = run_curl(curl)
    finally:
        for process in reversed(started):
            process.stop()
    assert events[-1] == "data: [DONE]"
    assert len(events) == 9  # eight tokens, then [DONE]


@pytest.mark.skipif(not ROUTER, reason="sglang-router is not installed")
def test_the_disaggregation_page_router_commands_work_as_written(tmp_path: Path) -> None:
    ports = dict(zip((8100, 8300, 8400, 8401), free_ports(4), strict=True))
    *commands, curl = readme_commands("--pd-disaggregation", ports)
    prefill, decode, router = commands
    started = []
    try:
        for name, command in (("prefill", prefill), ("decode", decode)):
            started.append(Process(f"readme-{name}", command, tmp_path / f"{name}.log"))
        for port in (ports[8100], ports[8300]):
            url = f"http://127.0.0.1:{port}"
            wait_until(f"{url} up", partial(healthy, url), TIMEOUT, *started)
        started.append(Process("readme-router", router, tmp_path / "router.log"))
        roles = {f"http://127.0.0.1:{ports[8100]}": "prefill"}
        roles[f"http://127.0.0.1:{ports[8300]}"] = "decode"
        router_url = f"http://127.0.0.1:{ports[8400]}"
        wait_until(
            "the router to register both sides",
            lambda: pd_registered(router_url, roles),
            TIMEOUT,
            *started,
        )
        events = run_curl(curl)
    finally:
        for process in reversed(started):
            process.stop()
    assert events[-1] == "data: [DONE]"
    assert len(events) == 9


# -- a prefill peer that is not one -------------------------------------------------------------


def test_a_decode_server_refuses_a_prefill_url_that_is_not_a_prefill_server(pair: Pair) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for url, why in ((dead, "could not read"), (pair.decode.url, "not a prefill worker")):
        result = serve_exits("--disaggregation-mode", "decode", "--prefill-url", url)
        assert result.returncode == 2, result.stderr
        assert "the prefill server is not usable" in result.stderr
        assert why in result.stderr
        assert result.stderr.count("\n") == 1  # one line

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
import socket
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

import trio_sglang as ts
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
from conftest import read
from trio_sglang.server import HTTPPrefill, ServerLimits, open_http_kv_rooms, serve
from trio_sglang.server._inflight import InFlight, bootstrap_rooms
from trio_sglang.server._kv_rooms_http import ROOMS_PATH, KVRoomsApp

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
            lambda: _registered(url, roles),
            TIMEOUT,
            router,
            *watched,
        )
        yield Routed(Pair(prefill, lone_decode), url)
    finally:
        router.stop()


def _registered(router: str, roles: dict[str, str]) -> bool:
    """Whether the router lists each URL as a healthy worker of its role."""
    try:
        workers = httpx.get(f"{router}/workers", timeout=2).json()["workers"]
    except (httpx.TransportError, ValueError, KeyError):
        return False
    listed = {w["url"]: w["worker_type"] for w in workers if w.get("is_healthy")}
    return all(listed.get(url) == role for url, role in roles.items())


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


async def test_the_rooms_routes_check_what_they_are_sent(prefill: Server, pair: Pair) -> None:
    async with httpx.AsyncClient(base_url=prefill.url, timeout=TIMEOUT) as client:
        rooms = "/bootstrap/rooms"
        # A room nobody holds: a long poll answers at once that nothing happened.
        with trio.fail_after(TIMEOUT / 2):
            answer = await client.get(f"{rooms}/7", params={"wait": "kv_sent", "hold": 30})
        assert answer.json() == {"events": []}
        bad: list[tuple[str, dict[str, Any], int]] = [
            (f"{rooms}/x", {"wait": "kv_sent"}, 404),
            (f"{rooms}/{2**63}", {"wait": "kv_sent"}, 404),
            (f"{rooms}/%C2%B2", {"wait": "kv_sent"}, 404),  # a digit, not an ASCII one
            (f"{rooms}/{'9' * 5000}", {"wait": "kv_sent"}, 404),
            (f"{rooms}/7", {"wait": "kv_lost"}, 400),
            (f"{rooms}/7", {"wait": "kv_sent", "hold": 31}, 400),
            (f"{rooms}/7", {"wait": "kv_sent", "hold": "soon"}, 400),
        ]
        for path, params, status in bad:
            assert (await client.get(path, params=params)).status_code == status, path
        for message in ({"events": ["kv_lost"]}, {"events": "kv_sent"}, {"done": 1}):
            assert (await client.post(f"{rooms}/7", json=message)).status_code == 400
        not_allowed = await client.put(f"{rooms}/7")
        assert (not_allowed.status_code, not_allowed.headers["allow"]) == (405, "GET, POST")
        # Only a prefill server hosts rooms.
        decode = await client.get(f"{pair.decode.url}{rooms}/7", params={"wait": "kv_sent"})
        assert decode.status_code == 404
    assert (await scrape(prefill)).rooms == 0


async def test_a_prefill_leg_whose_decode_side_aborted_stops_at_once(prefill: Server) -> None:
    """A router that keeps the prefill leg open when its client leaves (smg's prefill/decode
    mode) leaves the decode side's abort notification as the only word the prefill server
    gets: it stops the leg in that room there and then, not after its last forward."""
    room, port = 4242, int(prefill.url.rsplit(":", 1)[1])
    leg = {**generate(LONG_PROMPT, 1, stream=False), "bootstrap_room": room}
    leg |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    before = await Gains.start(prefill)
    answer: list[httpx.Response] = []

    async def run_leg(client: httpx.AsyncClient) -> None:
        answer.append(await client.post("/generate", json=leg))

    async def prefilling() -> bool:
        return (await before.update()).event("prefill_chunk") >= 1

    async with (
        httpx.AsyncClient(base_url=prefill.url, timeout=TIMEOUT) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(run_leg, client)
        room_path = f"{ROOMS_PATH}{room}"
        assert (await client.post(room_path, json={"events": ["decode_ready"]})).is_success
        await wait_for("the prefill leg's first forward", prefilling)
        aborted = {"events": ["decode_aborted"], "done": True}
        assert (await client.post(room_path, json=aborted)).is_success
    (response,) = answer
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["finish_reason"]["type"] == "abort"
    await wait_for("the prefill server idle, no room left", lambda: _idle(prefill))
    await before.update()
    assert before.event("prefill_chunk") < FORWARDS  # stopped after the forward in progress
    assert before.event("abort_applied") == 1
    assert before.event("kv_sent") == before.event("kv_failed") == 0
    assert before.value("trio_sglang_requests_total", outcome="aborted") == 1


def test_a_prefill_server_finds_its_requests_by_room_while_they_are_in_flight() -> None:
    inflight = InFlight()
    one = inflight.add("one", 1, bootstrap_rooms({"bootstrap_room": 7}))
    batch = inflight.add("batch", 2, bootstrap_rooms({"bootstrap_room": [8, 9]}))
    roomless = inflight.add("roomless", 1, bootstrap_rooms({}))
    inflight.stop_room(9)  # a room of the batch: the whole request stops, as aborted
    assert (one.stopped, batch.stopped, roomless.stopped) == (False, True, False)
    assert inflight.aborted(batch)
    assert not inflight.aborted(one)
    inflight.discard(one)
    inflight.stop_room(7)  # its request has ended: nothing left in that room
    assert not one.stopped
    again = inflight.add("again", 1, (7,))  # a room is free again once its request ended
    inflight.stop_room(7)
    assert again.stopped
    for ctx in (batch, roomless, again):
        inflight.discard(ctx)
    assert inflight.children == 0


async def _idle(server: Server) -> bool:
    metrics = await scrape(server)
    return metrics.live == metrics.rooms == 0


async def test_in_one_process_both_sides_forget_every_room() -> None:
    """The same pair in one trio run: here the decode side's own rooms can be counted too."""
    hosted = ts.SimKVRooms()
    timing = ts.SimDisaggTiming(prefill_time_per_token=0.01, prefill_chunk_tokens=4)
    prefill = ts.SimEngine(disaggregation_mode="prefill", kv_rooms=hosted, disagg_timing=timing)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        run = partial(serve, prefill, port=0, handle_signals=False, shutdown=stop, kv_rooms=hosted)
        (url,) = await nursery.start(run)
        async with open_http_kv_rooms() as rooms, HTTPPrefill(url) as peer:
            decode = ts.SimEngine(disaggregation_mode="decode", kv_rooms=rooms)
            async with ts.open_worker(decode, prefill=peer) as worker:
                whole = ts.RequestContext("whole")
                async with worker.generate(generate("Hello", 2), whole) as chunks:
                    assert len([chunk async for chunk in chunks]) == 2

                async def prefilling() -> bool:
                    return prefill.trace.counts["prefill_chunk"] >= 1 + 1

                left = ts.RequestContext("left")
                async with trio.open_nursery() as clients:
                    clients.start_soon(read, worker, generate(LONG_PROMPT, 8), left)
                    await wait_for("the second prefill computing", prefilling)
                    left.kill()

                async def forgotten() -> bool:
                    await trio.lowlevel.checkpoint()
                    live = prefill.live_requests() + decode.live_requests()
                    return live == len(hosted) == len(rooms) == 0

                await wait_for("both sides idle, every room forgotten", forgotten)
        stop.set()
    assert prefill.trace.counts["kv_sent"] == 1
    assert prefill.trace.counts["abort_applied"] + prefill.trace.counts["kv_failed"] == 1
    assert decode.trace.counts["abort_applied"] == 1


async def test_the_rooms_take_the_api_key_and_a_keyed_pair_still_pairs() -> None:
    """Before issue 28 anyone could make rooms on a prefill server, key or not."""
    hosted = ts.SimKVRooms()
    timing = ts.SimDisaggTiming(prefill_time_per_token=0.01, prefill_chunk_tokens=4)
    prefill = ts.SimEngine(disaggregation_mode="prefill", kv_rooms=hosted, disagg_timing=timing)
    limits = ServerLimits(api_key="pair-secret")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        run = partial(
            serve, prefill, port=0, handle_signals=False, shutdown=stop, kv_rooms=hosted,
            limits=limits,
        )  # fmt: skip
        (url,) = await nursery.start(run)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for key in (None, "wrong"):
                headers = {} if key is None else {"authorization": f"Bearer {key}"}
                made = await client.post(
                    "/bootstrap/rooms/7", json={"events": ["decode_ready"]}, headers=headers
                )
                assert made.status_code == 401, made.text
                polled = await client.get(
                    "/bootstrap/rooms/7", params={"wait": "kv_sent"}, headers=headers
                )
                assert polled.status_code == 401, polled.text
        assert len(hosted) == 0
        # A decode side that sends the pair's key pairs as before.
        async with (
            open_http_kv_rooms(api_key="pair-secret") as rooms,
            HTTPPrefill(url, api_key="pair-secret") as peer,
        ):
            decode = ts.SimEngine(disaggregation_mode="decode", kv_rooms=rooms)
            context = ts.RequestContext("keyed")
            async with (
                ts.open_worker(decode, prefill=peer) as worker,
                worker.generate(generate("Hello", 2), context) as chunks,
            ):
                assert len([chunk async for chunk in chunks]) == 2
        stop.set()
    assert prefill.trace.counts["kv_sent"] == 1


async def test_a_room_a_peer_made_and_left_is_forgotten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Before issue 28 such a room stayed for good: 20,000 POSTs, 20,000 rooms."""
    rooms = ts.SimKVRooms(forget_after=300.0)
    for room in range(1000):
        rooms.post(room, "decode_ready")
    await trio.sleep(299)
    assert len(rooms) == 1000
    waiting = trio.Event()

    async def wait_on_room_0() -> None:
        waiting.set()
        await rooms.wait(0, frozenset({"kv_sent"}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_on_room_0)
        await waiting.wait()
        await trio.sleep(2)
        assert len(rooms) == 1  # the one someone waits on stays
        await trio.sleep(300)
        assert len(rooms) == 1
        rooms.post(0, "kv_sent")
    await trio.sleep(300)
    assert len(rooms) == 0


async def test_a_prefill_server_makes_no_room_past_its_limit() -> None:
    rooms = ts.SimKVRooms()
    app = KVRoomsApp(rooms, read_timeout=1.0, on_decode_aborted=lambda room: None, max_rooms=2)
    statuses = [await _post_room(app, room, {"events": ["decode_ready"]}) for room in range(3)]
    assert statuses == [200, 200, 503]
    assert len(rooms) == 2
    # Events for a room it holds, and a decode side's "done", still land.
    assert await _post_room(app, 1, {"events": ["decode_aborted"], "done": True}) == 200
    assert await _post_room(app, 9, {"done": True}) == 200


async def _post_room(app: KVRoomsApp, room: int, message: dict[str, Any]) -> int:
    """One ``POST`` of ``message`` to ``app`` as ASGI; the answer's status."""
    body = json.dumps(message).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": f"{ROOMS_PATH}{room}",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(sent[0]["status"])


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
            lambda: _registered(router_url, roles),
            TIMEOUT,
            *started,
        )
        events = run_curl(curl)
    finally:
        for process in reversed(started):
            process.stop()
    assert events[-1] == "data: [DONE]"
    assert len(events) == 9


# -- configuration errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-url", "http://127.0.0.1:1"], "--disaggregation-mode decode"),
        (
            ["--disaggregation-mode", "prefill", "--prefill-url", "http://127.0.0.1:1"],
            "--disaggregation-mode decode",
        ),
        (["--disaggregation-mode", "decode", "--prefill-bootstrap-port", "9"], "--prefill-url"),
        (["--disaggregation-mode", "decode", "--prefill-url", "127.0.0.1:1"], "http(s)://"),
    ],
)
def test_serve_refuses_bad_disaggregation_flags(args: list[str], message: str) -> None:
    result = serve_exits(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stderr.count("\n") == 1  # one line


def test_a_decode_server_refuses_a_prefill_url_that_is_not_a_prefill_server(pair: Pair) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    for url, why in ((dead, "could not read"), (pair.decode.url, "not a prefill worker")):
        result = serve_exits("--disaggregation-mode", "decode", "--prefill-url", url)
        assert result.returncode == 2, result.stderr
        assert "the prefill server is not usable" in result.stderr
        assert why in result.stderr
        assert result.stderr.count("\n") == 1  # one line


def test_a_decode_server_whose_prefill_server_hangs_says_so_in_one_line() -> None:
    """A prefill server that accepts connections and never answers: its 5 s bound, then exit 2."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as hanging:  # never accepts
        url = f"http://127.0.0.1:{hanging.getsockname()[1]}"
        result = serve_exits("--disaggregation-mode", "decode", "--prefill-url", url)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"the prefill server is not usable: could not read {url}/capabilities: no answer in "
        "full within 5.0 s"
    ]
    assert result.stdout == ""


def serve_exits(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trio_sglang", "serve", "--port", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)

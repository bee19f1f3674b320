"""The prefill server's KV rooms: SGLang's bootstrap server, hosted on its HTTP port.

A decode side makes a room per request (``POST /bootstrap/rooms/{room}``) and
long-polls it for the prefill's events; a prefill server stops the leg in a
room whose decode side aborted, forgets a room nobody waits on, takes the
server's API key, and makes no room past its limit. Real ``serve`` processes
from ``test_disagg_serve.py`` where the route is judged over HTTP; one trio
run or the ASGI app alone where both sides' rooms must be counted.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import trio

import test_disagg_serve
import trio_sglang as ts
from conftest import read
from test_disagg_serve import (
    FORWARDS,
    LONG_PROMPT,
    TIMEOUT,
    Gains,
    Pair,
    Server,
    generate,
    scrape,
    wait_for,
)
from trio_sglang.server import HTTPPrefill, ServerLimits, open_http_kv_rooms, serve
from trio_sglang.server._inflight import InFlight, bootstrap_rooms
from trio_sglang.server._kv_rooms_http import ROOMS_PATH, KVRoomsApp

#: test_disagg_serve.py's servers: a prefill server, and a decode server paired with it.
log_dir = test_disagg_serve.log_dir
prefill = test_disagg_serve.prefill
pair = test_disagg_serve.pair


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
    """Only a peer with the pair's key makes or polls a room: without it, anyone could."""
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
    """A room nobody waits on is forgotten after ``forget_after``, or rooms would grow with
    every POST."""
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

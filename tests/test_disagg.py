"""Prefill/decode disaggregation on MockClock: a cancel in every phase of each leg.

A decode worker runs each request's prefill leg at an in-process prefill
worker, beside its own decode leg. Whatever the moment of the cancel, both
sides must end with nothing live, and promptly: the prefill side does at
most the chunk it was computing, the decode side never waits out its KV
timeout, and no token is decoded after the cancel.

Timeline of one request (``pair()``'s timings, a 10-word prompt):
tokenizing 0-1.5 on both sides; at 1.5 both are dispatched; the decode
side's handshake lands at 2.0 (prealloc 1.5-2.0, prefill bootstrap
1.5-2.0); prefill chunks of 4, 4 and 2 tokens end at 2.4, 2.8 and 3.0;
the KV transfer runs 3.0-3.5; decode tokens at 4.5, 5.5 and 6.5.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import SLOW_KNOBS, TIMING, sim_pair, slow_sim
from trio_sglang._core._disagg import PEER_CHECK_TIMEOUT
from trio_sglang.testing import Faults, FaultyEngine

REQUEST: dict[str, Any] = {
    "text": "one two three four five six seven eight nine ten",
    "sampling_params": {"max_new_tokens": 3},
}


@dataclass
class Pair:
    prefill: ts.SimEngine
    decode: ts.SimEngine
    rooms: ts.SimKVRooms
    prefill_worker: ts.Worker
    worker: ts.Worker

    def live(self) -> set[str]:
        return self.prefill.live_rids() | self.decode.live_rids()


class WithoutCancelAnytime:
    """A prefill peer that does not advertise ``disagg_prefill_cancel_anytime_v1``."""

    def __init__(self, inner: ts.InProcessPrefill) -> None:
        self._inner = inner
        self.name = "old-prefill"
        self.bootstrap_host = inner.bootstrap_host
        self.bootstrap_port = inner.bootstrap_port

    async def capabilities(self) -> Mapping[str, Any]:
        capabilities = dict(await self._inner.capabilities())
        capabilities["features"] = {
            k: v for k, v in capabilities["features"].items() if "disagg" not in k
        }
        return capabilities

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        await self._inner.prefill(request, public_id)


@asynccontextmanager
async def pair(
    *, prefill_faults: Faults | None = None, cancel_anytime: bool = True
) -> AsyncIterator[Pair]:
    rooms = ts.SimKVRooms()
    prefill, decode = sim_pair(rooms)
    prefill_engine: ts.Engine = prefill
    if prefill_faults is not None:
        prefill_engine = FaultyEngine(prefill, prefill_faults)
    async with ts.open_worker(prefill_engine) as prefill_worker:
        peer: ts.PrefillPeer = ts.InProcessPrefill(prefill_worker)
        if not cancel_anytime:
            peer = WithoutCancelAnytime(ts.InProcessPrefill(prefill_worker))
        async with ts.open_worker(decode, prefill=peer) as worker:
            yield Pair(prefill, decode, rooms, prefill_worker, worker)


async def stream(worker: ts.Worker, ctx_id: str, *, cancel_at: float = 1e9) -> list[float]:
    """Read until the end or ``cancel_at``; the clock times of the chunks."""
    times: list[float] = []
    ctx = ts.RequestContext(ctx_id)
    with trio.move_on_at(cancel_at):
        async with worker.generate(REQUEST, ctx) as chunks:
            async for _ in chunks:
                times.append(trio.current_time())
    return times


def kinds(engine: ts.SimEngine) -> list[tuple[str, str]]:
    return [(event.kind, event.detail) for event in engine.trace if event.kind != "token"]


async def test_an_uncancelled_request_runs_both_legs_to_the_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with pair() as p:
        assert await stream(p.worker, "whole") == [4.5, 5.5, 6.5]
    assert [kind for kind, _ in kinds(p.prefill)] == [
        "registered",
        "dispatched",
        "bootstrapped",
        "prefill_chunk",
        "prefill_chunk",
        "prefill_chunk",
        "kv_sent",
        "finished",
    ]
    assert [kind for kind, _ in kinds(p.decode)] == [
        "registered",
        "dispatched",
        "bootstrapped",
        "kv_received",
        "finished",
    ]
    assert p.live() == set()
    assert len(p.rooms) == 0


@dataclass(frozen=True)
class Phase:
    cancel_at: float
    #: The prefill side's last event: what stopped it, and in which queue.
    prefill_end: set[tuple[str, str]]
    #: The decode side's last event.
    decode_end: tuple[str, str]
    #: Prefill chunks computed in all (the one running at the cancel finishes).
    prefill_chunks: int


PHASES = {
    # Neither side was dispatched: both forget the request.
    "both tokenizing": Phase(0.5, {("released", "")}, ("released", ""), 0),
    # Prefill waits for the handshake; decode is making it.
    "bootstrap / prealloc": Phase(
        1.7,
        {("abort_applied", "bootstrap"), ("kv_failed", "bootstrap")},
        ("abort_applied", "prealloc"),
        0,
    ),
    # The second chunk is computing (2.4-2.8): it finishes, nothing more.
    "prefilling / waiting for KV": Phase(
        2.5, {("abort_applied", "prefilling")}, ("abort_applied", "transfer"), 2
    ),
    # The KV cache is on its way (3.0-3.5).
    "transferring / waiting for KV": Phase(
        3.2, {("abort_applied", "transferring")}, ("abort_applied", "transfer"), 3
    ),
    # The prefill leg is over; decode is between tokens.
    "prefill done / mid-stream": Phase(5.0, {("finished", "")}, ("abort_applied", ""), 3),
}


@pytest.mark.parametrize("phase", PHASES.values(), ids=PHASES.keys())
async def test_a_cancel_in_any_phase_stops_both_legs(
    phase: Phase, autojump_clock: trio.testing.MockClock
) -> None:
    async with pair() as p:
        chunks = await stream(p.worker, "cancelled", cancel_at=phase.cancel_at)
        assert trio.current_time() == phase.cancel_at  # the caller's stream closed at once
        await trio.sleep(400)  # past the decode side's KV timeout, had it been left waiting
        assert p.worker.pending_cleanups == p.prefill_worker.pending_cleanups == 0
    assert all(t < phase.cancel_at for t in chunks)
    assert p.live() == set()
    assert len(p.rooms) == 0
    assert kinds(p.prefill)[-1] in phase.prefill_end
    assert kinds(p.decode)[-1] == phase.decode_end
    assert [kind for kind, _ in kinds(p.decode)].count("kv_timeout") == 0
    assert [kind for kind, _ in kinds(p.prefill)].count("prefill_chunk") == phase.prefill_chunks
    tokens = [e.time for e in p.decode.trace if e.kind == "token"]
    assert all(t <= phase.cancel_at for t in tokens)


async def test_a_request_killed_before_its_first_pull_reaches_neither_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with pair() as p:
        ctx = ts.RequestContext("gone")
        ctx.kill()
        async with p.worker.generate(REQUEST, ctx) as chunks:
            async for _ in chunks:
                pytest.fail("unreachable")
        await trio.sleep(10)
    assert list(p.prefill.trace) == list(p.decode.trace) == []


async def test_a_cancel_while_waiting_behind_another_prefill_never_computes_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with pair() as p, trio.open_nursery() as nursery:
        nursery.start_soon(stream, p.worker, "ahead")
        await trio.sleep(0.1)  # dispatched 0.1 s later: its prefill waits for the first one's
        await stream(p.worker, "behind", cancel_at=2.5)
        await trio.sleep(400)
    (ahead, behind) = sorted(
        {e.rid for e in p.prefill.trace}, key=lambda rid: p.prefill.trace.of(rid)[0].time
    )
    assert p.prefill.trace.kinds(behind) == [
        "registered",
        "dispatched",
        "bootstrapped",
        "abort_requested",
        "abort_applied",
    ]
    assert p.prefill.trace.of(behind)[-1].detail == "waiting"
    assert p.prefill.trace.kinds(ahead)[-1] == "finished"
    assert p.live() == set()


async def test_a_room_whose_other_side_never_came_is_forgotten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The decode leg is dispatched at 1.0 and its handshake posted at 1.5;
    # the prefill leg, still tokenizing at the cancel, never reaches its
    # scheduler: only one side is ever done with the room.
    rooms = ts.SimKVRooms(forget_after=300.0)
    knobs = {**SLOW_KNOBS, "dispatch_delay": 0.0, "kv_rooms": rooms, "disagg_timing": TIMING}
    prefill = ts.SimEngine(**{**knobs, "tokenize_delay": 2.0}, disaggregation_mode="prefill")
    decode = ts.SimEngine(**knobs, disaggregation_mode="decode")
    async with ts.open_worker(prefill) as prefill_worker:
        peer = ts.InProcessPrefill(prefill_worker)
        async with ts.open_worker(decode, prefill=peer) as worker:
            await stream(worker, "half", cancel_at=1.7)
            await trio.sleep(299)
            assert len(rooms) == 1  # kept while the other side may still come
            await trio.sleep(2)
            assert len(rooms) == 0
    assert prefill.trace.kinds(prefill.trace[0].rid) == ["registered", "released"]
    assert prefill.live_rids() == decode.live_rids() == set()


async def test_a_failed_prefill_fails_the_request_and_stops_its_decode_leg(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with pair(prefill_faults=Faults(stream_error_after=0)) as p:
        with pytest.raises(ts.EngineError, match=r"the prefill of doomed failed \(EngineError\)"):
            await stream(p.worker, "doomed")
        assert trio.current_time() == 0  # at once: the prefill side failed before tokenizing
        await trio.sleep(400)
    assert p.live() == set()
    assert kinds(p.decode) == [("registered", ""), ("released", "")]
    faults = [r.getMessage() for r in caplog.records if "engine fault" in r.getMessage()]
    assert [m.split(":")[0] for m in faults] == [
        "engine fault stream_error",  # at the prefill worker
        "engine fault prefill_failed",  # at the decode worker
    ]


async def test_a_prefill_peer_without_cancel_anytime_is_left_to_finish_and_said_so(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with pair(cancel_anytime=False) as p:
        await stream(p.worker, "cancelled", cancel_at=2.5)
        await stream(p.worker, "again", cancel_at=trio.current_time() + 2.5)
        await trio.sleep(400)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "old-prefill does not advertise disagg_prefill_cancel_anytime_v1" in warnings[0]
    # The prefill was not cancelled: it computed every chunk, and failed only
    # when the transfer found its decode side gone.
    first = p.prefill.trace.of(
        min({e.rid for e in p.prefill.trace}, key=lambda rid: p.prefill.trace.of(rid)[0].time)
    )
    assert [e.kind for e in first].count("prefill_chunk") == 3
    assert (first[-1].kind, first[-1].detail) == ("kv_failed", "transferring")
    assert p.live() == set()


async def test_capabilities_of_each_role(autojump_clock: trio.testing.MockClock) -> None:
    async with pair() as p:
        prefill_caps = p.prefill_worker.capabilities()
        decode_caps = p.worker.capabilities()
    assert prefill_caps["role"] == "prefill"
    assert prefill_caps["features"]["disagg_prefill_cancel_anytime_v1"] is True
    assert prefill_caps["engine"]["disaggregation_mode"] == "prefill"
    assert decode_caps["role"] == "decode"
    assert decode_caps["features"]["disagg_prefill_cancel_anytime_v1"] is False


@pytest.mark.parametrize(
    ("side", "request_", "message"),
    [
        ("prefill", REQUEST, "a prefill worker needs bootstrap_room"),
        ("prefill", {**REQUEST, "bootstrap_room": -1}, "a prefill worker needs bootstrap_room"),
        ("prefill", {**REQUEST, "bootstrap_room": True}, "a prefill worker needs bootstrap_room"),
        ("prefill", {**REQUEST, "bootstrap_room": 2**63}, "a prefill worker needs bootstrap_room"),
        ("prefill", {**REQUEST, "bootstrap_room": 1, "bootstrap_port": 0}, "bootstrap_port"),
        ("prefill", {**REQUEST, "bootstrap_room": 1, "bootstrap_host": 5}, "bootstrap_host"),
        ("decode", {**REQUEST, "sampling_params": {"n": 2}}, "one prompt with n = 1"),
        ("decode", {**REQUEST, "bootstrap_room": 3}, "needs bootstrap_host"),
        ("decode", {**REQUEST, "text": ["a", "b"]}, "one prompt with n = 1"),
    ],
)
async def test_bad_disaggregated_requests_are_refused_before_either_engine(
    side: str, request_: dict[str, Any], message: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with pair() as p:
        worker = p.prefill_worker if side == "prefill" else p.worker
        with pytest.raises(ts.InvalidRequest, match=message):
            async with worker.generate(request_, ts.RequestContext("bad")):
                pytest.fail("unreachable")
    assert list(p.prefill.trace) == list(p.decode.trace) == []


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        # Found by the HTTP corpus at 10,000 examples: it reached the engine.
        ({**REQUEST, "bootstrap_host": []}, "bootstrap_host must be a string, got list"),
        ({**REQUEST, "bootstrap_port": "8998"}, "bootstrap_port must be an int"),
        ({**REQUEST, "bootstrap_room": -1}, "bootstrap_room must be an int in"),
        ({"text": ["a", "b"], "bootstrap_room": [1]}, "one value per prompt"),
    ],
)
async def test_bootstrap_fields_are_checked_on_an_aggregated_worker_too(
    request_: dict[str, Any], message: str, autojump_clock: trio.testing.MockClock
) -> None:
    engine = ts.SimEngine()
    async with ts.open_worker(engine) as worker:
        with pytest.raises(ts.InvalidRequest, match=message):
            async with worker.generate(request_, ts.RequestContext("bad")):
                pytest.fail("unreachable")
    assert list(engine.trace) == []


async def test_a_scalar_room_on_a_batch_is_accepted_by_a_prefill_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with pair() as p:
        body = {"text": ["a b", "c d"], "bootstrap_host": "127.0.0.1", "bootstrap_room": 40}
        with trio.move_on_after(1.0):  # no decode side: cancelled while bootstrapping
            async with p.prefill_worker.generate(body, ts.RequestContext("batch")) as chunks:
                async for _ in chunks:
                    pass
        await trio.sleep(10)
    assert p.live() == set()
    assert {e.rid for e in p.prefill.trace if e.kind == "registered"} != set()


async def test_a_decode_worker_without_a_peer_needs_the_routers_bootstrap_fields(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rooms = ts.SimKVRooms()
    decode = slow_sim(disaggregation_mode="decode", kv_rooms=rooms)
    async with ts.open_worker(decode) as worker:
        with pytest.raises(ts.InvalidRequest, match="without a prefill peer"):
            async with worker.generate(REQUEST, ts.RequestContext("bad")):
                pytest.fail("unreachable")
    assert list(decode.trace) == []


async def test_a_decode_worker_behind_a_router_runs_only_its_own_leg(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # What sglang-router's PD mode does: the same body, with the bootstrap
    # fields, to a prefill worker and to a decode worker, concurrently.
    prefill, decode = sim_pair(ts.SimKVRooms())
    body = {**REQUEST, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}
    times = []
    async with (
        ts.open_worker(prefill) as prefill_worker,
        ts.open_worker(decode) as worker,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(ts.InProcessPrefill(prefill_worker).prefill, body, "routed")
        async with worker.generate(body, ts.RequestContext("routed")) as chunks:
            async for _ in chunks:
                times.append(trio.current_time())
    assert times == [4.5, 5.5, 6.5]
    assert prefill.live_rids() == decode.live_rids() == set()


async def test_a_prefill_peer_is_only_for_a_decode_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ts.open_worker(ts.SimEngine()) as aggregated:
        with pytest.raises(ValueError, match="decode mode"):
            async with ts.open_worker(ts.SimEngine(), prefill=ts.InProcessPrefill(aggregated)):
                pytest.fail("unreachable")


# -- the sim's SGLang semantics, engine level -----------------------------------------


async def drain_engine(engine: ts.SimEngine, request: dict[str, Any]) -> list[dict[str, Any]]:
    return [out async for out in engine.generate({**request, "stream": True})]


@asynccontextmanager
async def both_legs(
    prefill: ts.SimEngine, decode: ts.SimEngine, body: dict[str, Any]
) -> AsyncIterator[None]:
    """Both engines running ``body`` (rids ``p`` and ``d``), as a router sends it; to the end."""
    async with prefill.running(), decode.running(), trio.open_nursery() as nursery:
        nursery.start_soon(drain_engine, prefill, {**body, "rid": "p"})
        nursery.start_soon(drain_engine, decode, {**body, "rid": "d"})
        yield


async def test_a_prefill_without_its_decode_side_fails_after_the_bootstrap_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timing = ts.SimDisaggTiming(bootstrap_timeout=300.0)
    prefill = slow_sim(
        disaggregation_mode="prefill", kv_rooms=ts.SimKVRooms(), disagg_timing=timing
    )
    async with prefill.running():
        (out,) = await drain_engine(prefill, {**REQUEST, "rid": "p", "bootstrap_room": 5})
    reason = out["meta_info"]["finish_reason"]
    assert reason["status_code"] == 500
    assert "timed out after 300.0s in KVPoll.Bootstrapping" in reason["message"]
    assert trio.current_time() == 1.5 + 300.0
    assert kinds(prefill)[-1] == ("kv_timeout", "bootstrap")


async def test_a_decode_abort_during_its_handshake_does_not_reach_the_prefill_side(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # SGLang sends the abort notification only once the handshake gave the
    # decode side the prefill side's address: the prefill waits it out.
    prefill, decode = sim_pair(ts.SimKVRooms())
    body = {**REQUEST, "bootstrap_host": "127.0.0.1", "bootstrap_room": 9}
    async with both_legs(prefill, decode, body):
        await trio.sleep(1.7)  # decode in prealloc (1.5-2.0)
        await decode.abort("d")
    assert kinds(decode)[-1] == ("abort_applied", "prealloc")
    assert kinds(prefill)[-1] == ("kv_timeout", "bootstrap")
    assert trio.current_time() == 1.5 + TIMING.bootstrap_timeout


async def test_a_scalar_room_on_a_native_batch_becomes_one_room_per_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rooms = ts.SimKVRooms()
    prefill, decode = sim_pair(rooms)
    body = {"text": ["a b", "c d"], "bootstrap_host": "127.0.0.1", "bootstrap_room": 40}
    async with both_legs(prefill, decode, body):
        pass
    paired = {e.detail for e in decode.trace if e.kind == "kv_received"}
    assert paired == {"40", "41"}
    assert len(rooms) == 0


# -- regressions: what the engine ends, and a cancel behind a long forward ------------


@pytest.mark.parametrize("mode", ["prefill", "decode"])
async def test_a_request_the_engine_fails_names_only_its_public_id(
    mode: ts.DisaggregationMode, autojump_clock: trio.testing.MockClock
) -> None:
    """A bootstrap (prefill) or KV transfer (decode) timeout: SGLang's message names the rid."""
    engine = slow_sim(disaggregation_mode=mode, kv_rooms=ts.SimKVRooms(), disagg_timing=TIMING)
    body = {**REQUEST, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5}
    async with ts.open_worker(engine) as worker:
        ctx = ts.RequestContext("pub-alone")
        async with worker.generate(body, ctx, output="native") as chunks:
            (out,) = [chunk async for chunk in chunks]
    (rid,) = {event.rid for event in engine.trace}
    message = out["meta_info"]["finish_reason"]["message"]
    assert "timed out after 300.0s" in message
    assert "req.rid='pub-alone'" in message
    assert rid not in repr(out)


async def test_a_cancel_behind_a_long_prefill_forward_sends_one_abort(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The abort waits for the 1.6 s forward (past ``release_timeout``); no second one goes.

    SGLang sends one abort per request: a second, sent while the first waits
    behind the forward, would be dropped (``abort_dropped``).
    """
    one_long_forward = ts.SimDisaggTiming(
        prefill_time_per_token=0.16, prefill_chunk_tokens=16, bootstrap_delay=0.5
    )
    prefill, decode = sim_pair(ts.SimKVRooms(), timing=one_long_forward)
    async with (
        ts.open_worker(prefill) as prefill_worker,
        ts.open_worker(decode, prefill=ts.InProcessPrefill(prefill_worker)) as worker,
    ):
        assert await stream(worker, "cancelled", cancel_at=2.1) == []  # prefilling 2.0-3.6
        await trio.sleep(10)
        assert prefill_worker.pending_cleanups == 0
    (rid,) = {event.rid for event in prefill.trace}
    aborts = [(e.time, e.kind, e.detail) for e in prefill.trace.of(rid) if "abort" in e.kind]
    assert aborts == [
        (2.1, "abort_requested", ""),
        (pytest.approx(3.6), "abort_applied", "prefilling"),
    ]
    assert prefill.live_rids() == decode.live_rids() == set()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


class SilentPeer:
    """A prefill peer that never answers (a server that accepts and then hangs)."""

    name = "silent-prefill"
    bootstrap_host = "127.0.0.1"
    bootstrap_port = 8998

    async def capabilities(self) -> Mapping[str, Any]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        raise AssertionError("a worker that could not check its peer must not start")


async def test_a_prefill_peer_that_never_answers_fails_the_worker_start_with_prefill_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    decode = slow_sim(disaggregation_mode="decode", kv_rooms=ts.SimKVRooms(), disagg_timing=TIMING)
    failed = pytest.RaisesExc(ts.PrefillFailed, match="silent-prefill did not answer")
    with pytest.RaisesGroup(failed, flatten_subgroups=True):  # through the engine's nursery
        async with ts.open_worker(decode, prefill=SilentPeer()):
            pytest.fail("the worker started without its peer's capabilities")
    assert trio.current_time() == PEER_CHECK_TIMEOUT

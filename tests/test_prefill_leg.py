"""A decode request's prefill leg: a peer's failure is a fault that says where, the cause of
the block's error, and no fault once the request has ended."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import HELLO, RecordingEngine, fault_records, read, slow_sim
from trio_sglang._core._disagg import CANCEL_ANYTIME

# -- a decode request's prefill leg --------------------------------------------------------------


class FailingPeer:
    """A prefill worker whose prefill fails at ``fail_at``; it counts the legs it was given."""

    name = "failing-prefill"
    bootstrap_host = "127.0.0.1"
    bootstrap_port = 8998

    def __init__(self, *, fail_at: float, cancel_anytime: bool = True) -> None:
        self.fail_at = fail_at
        self.cancel_anytime = cancel_anytime
        self.legs = 0

    async def capabilities(self) -> Mapping[str, Any]:
        await trio.lowlevel.checkpoint()
        return {"features": {CANCEL_ANYTIME: self.cancel_anytime}}

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        self.legs += 1
        await trio.sleep_until(self.fail_at)
        raise ts.PrefillFailed("no KV cache for you")


def decode_engine() -> RecordingEngine:
    return RecordingEngine(slow_sim(disaggregation_mode="decode", kv_rooms=ts.SimKVRooms()))


@pytest.mark.mutant_pin
async def test_a_prefill_leg_failing_while_its_request_is_open_is_a_fault_that_says_where(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    engine = decode_engine()
    async with ts.open_worker(engine, prefill=FailingPeer(fail_at=1.0)) as worker:
        with pytest.raises(ts.EngineError, match="the prefill of pub failed"):
            await read(worker, HELLO, ts.RequestContext("pub"))
    (body,) = engine.bodies
    (record,) = fault_records(caplog)
    assert record.getMessage() == (
        f"engine fault prefill_failed: request pub (rids {body['rid']}): the prefill leg at "
        f"failing-prefill (room {body['bootstrap_room']}) failed: "
        "PrefillFailed('no KV cache for you')"
    )


@pytest.mark.mutant_pin
async def test_the_prefill_legs_failure_is_the_cause_of_the_blocks_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ts.open_worker(decode_engine(), prefill=FailingPeer(fail_at=1.0)) as worker:
        with pytest.raises(ts.EngineError) as raised:
            await read(worker, HELLO, ts.RequestContext("pub"))
    assert isinstance(raised.value.__cause__, ts.PrefillFailed)
    assert raised.value.__suppress_context__


class OwnError(Exception):
    pass


@pytest.mark.mutant_pin
async def test_a_block_that_raises_its_own_error_gets_it_back_not_the_prefills(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The prefill leg failed (at 1.0) and cancelled the block; the body raised first, its own."""

    async def raise_own_error(worker: ts.Worker) -> None:
        async with worker.generate(HELLO, ts.RequestContext("pub")) as chunks:
            with trio.CancelScope(shield=True):  # the pull (it starts the legs) outlives 1.0
                async with trio.open_nursery() as pulling:
                    pulling.start_soon(chunks.__anext__)
                    await trio.sleep(1.5)
                    pulling.cancel_scope.cancel()
            raise OwnError  # no checkpoint since the leg failed: the block's Cancelled never came

    async with ts.open_worker(decode_engine(), prefill=FailingPeer(fail_at=1.0)) as worker:
        with pytest.raises(OwnError):
            await raise_own_error(worker)
    assert trio.current_time() == 1.5


@pytest.mark.mutant_pin
async def test_a_prefill_leg_failing_after_its_request_ended_is_no_fault_only_a_debug_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that cannot be cancelled: its leg runs on, bounded, and fails at 1.0 (expected)."""
    caplog.set_level(logging.DEBUG, logger="trio_sglang")
    peer = FailingPeer(fail_at=1.0, cancel_anytime=False)
    async with ts.open_worker(decode_engine(), prefill=peer) as worker:
        with trio.move_on_after(0.5):
            await read(worker, HELLO, ts.RequestContext("pub"))
        await trio.sleep(1.0)
    assert fault_records(caplog) == []
    assert "prefill leg of pub ended with PrefillFailed('no KV cache for you')" in caplog.messages


@pytest.mark.mutant_pin
async def test_a_decode_worker_with_a_peer_decodes_a_routed_request_without_a_leg_of_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """sglang-router ran the prefill: the request carries its bootstrap fields."""
    peer = FailingPeer(fail_at=0.0)
    routed = {**HELLO, "bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 7}
    engine = decode_engine()
    async with ts.open_worker(engine, prefill=peer) as worker:
        with trio.move_on_after(1.0):  # no prefill side runs here: the decode leg waits
            await read(worker, routed, ts.RequestContext("routed"))
    assert peer.legs == 0
    assert engine.bodies[0]["bootstrap_room"] == 7

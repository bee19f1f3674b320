"""Prefill/decode pairs under random timings, prompts and cancel moments (Hypothesis).

Apart from ``test_disagg.py``, whose MockClock tests are mutation testing's
oracle: a property test draws new cases every run, so a mutant's verdict
could change from one run to the next. ``nox -s fuzz`` runs it at 10,000
examples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_sglang as ts
from _fuzz import fuzz_settings
from conftest import sim_pair

# -- property: random timings, prompts and cancel moments --------------------------

FUZZ_BUDGET = {"test_disaggregated_cancels_at_random_moments": 300}


def fuzz_settings_for(test_name: str) -> settings:
    return fuzz_settings(FUZZ_BUDGET, test_name)


class RecordingPeer:
    """An in-process prefill peer that notes which room each public id got."""

    def __init__(self, inner: ts.InProcessPrefill) -> None:
        self._inner = inner
        self.name = inner.name
        self.bootstrap_host = inner.bootstrap_host
        self.bootstrap_port = inner.bootstrap_port
        self.rooms: dict[str, int] = {}

    async def capabilities(self) -> Mapping[str, Any]:
        return await self._inner.capabilities()

    async def prefill(self, request: Mapping[str, Any], public_id: str) -> None:
        self.rooms[public_id] = request["bootstrap_room"]
        await self._inner.prefill(request, public_id)


@st.composite
def disagg_examples(draw: st.DrawFn) -> dict[str, Any]:
    seconds = st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5])
    return {
        "knobs": {
            "tokenize_delay": draw(seconds),
            "dispatch_delay": draw(seconds),
            "first_token_delay": draw(seconds),
            "token_interval": draw(st.sampled_from([0.001, 0.01, 0.1])),
        },
        "timing": ts.SimDisaggTiming(
            prefill_time_per_token=draw(st.sampled_from([0.0, 0.001, 0.01])),
            prefill_chunk_tokens=draw(st.integers(1, 16)),
            bootstrap_delay=draw(seconds),
            kv_transfer_delay=draw(seconds),
            kv_wait_timeout=100.0,
        ),
        "requests": draw(
            st.lists(
                st.tuples(
                    st.integers(1, 40),  # prompt words
                    st.integers(1, 4),  # max_new_tokens
                    st.one_of(st.none(), st.floats(0, 3)),  # cancel moment
                    st.floats(0, 1),  # start moment
                ),
                min_size=1,
                max_size=4,
            )
        ),
    }


async def run_disagg_example(example: dict[str, Any]) -> None:
    # A room one side never reached is forgotten after forget_after: well
    # inside the settling time, which stays short of the KV timeout.
    rooms = ts.SimKVRooms(forget_after=20.0)
    prefill, decode = sim_pair(rooms, example["knobs"], example["timing"])
    cancelled_at: dict[str, float] = {}

    async def client(i: int, words: int, tokens: int, cancel: float | None, start: float) -> None:
        await trio.sleep(start)
        request = {"text": "w " * words, "sampling_params": {"max_new_tokens": tokens}}
        ctx = ts.RequestContext(f"r{i}")
        deadline = trio.current_time() + cancel if cancel is not None else math.inf
        with trio.move_on_at(deadline) as scope:
            async with worker.generate(request, ctx) as chunks:
                async for _ in chunks:
                    assert trio.current_time() < deadline
        if scope.cancelled_caught:
            # The stream closed at the cancel (MockClock sums floats: to the nanosecond).
            assert trio.current_time() == pytest.approx(deadline, abs=1e-9)
            cancelled_at[ctx.id] = deadline

    async with ts.open_worker(prefill) as prefill_worker:
        peer = RecordingPeer(ts.InProcessPrefill(prefill_worker))
        async with ts.open_worker(decode, prefill=peer) as worker:
            async with trio.open_nursery() as nursery:
                for i, spec in enumerate(example["requests"]):
                    nursery.start_soon(client, i, *spec)
            await trio.sleep(50)  # settled, and short of the decode side's KV timeout
            assert prefill.live_rids() == decode.live_rids() == set()
            assert len(rooms) == 0
    assert "kv_timeout" not in [event.kind for event in decode.trace]
    prefill_rid = {e.detail: e.rid for e in prefill.trace if e.kind == "bootstrapped"}
    decode_rid = {e.detail: e.rid for e in decode.trace if e.kind == "bootstrapped"}
    for public_id, when in cancelled_at.items():
        room = str(peer.rooms.get(public_id))
        tokens = [e for e in decode.trace.of(decode_rid.get(room, "")) if e.kind == "token"]
        assert all(e.time <= when for e in tokens), public_id
        late = [
            e
            for e in prefill.trace.of(prefill_rid.get(room, ""))
            if e.kind == "prefill_chunk" and e.time > when
        ]
        assert len(late) <= 1, public_id  # only the chunk computing at the cancel


@fuzz_settings_for("test_disaggregated_cancels_at_random_moments")
@given(example=disagg_examples())
def test_disaggregated_cancels_at_random_moments(example: dict[str, Any]) -> None:
    trio.run(run_disagg_example, example, clock=trio.testing.MockClock(autojump_threshold=0))

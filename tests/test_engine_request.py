"""What the engine is asked for a caller's request: always a stream, under a rid the worker
mints; a batch, and the bootstrap fields of a prefill/decode pair, checked at their bounds."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import HELLO, RecordingEngine, read, slow_sim
from trio_sglang.testing import Faults, FaultyEngine

# -- what the engine is asked --------------------------------------------------------------------


@pytest.mark.mutant_pin
@pytest.mark.parametrize("stream", [True, False, None], ids=["stream", "no-stream", "unset"])
async def test_the_engine_is_always_asked_to_stream_under_a_minted_rid(
    stream: bool | None, autojump_clock: trio.testing.MockClock
) -> None:
    """The worker reads outputs as they come, whatever the caller's ``stream`` said."""
    engine = RecordingEngine(slow_sim())
    request = {**HELLO, "rid": "caller-rid"}
    if stream is not None:
        request["stream"] = stream
    async with ts.open_worker(engine) as worker:
        assert await read(worker, request, ts.RequestContext("pub")) == 5
    (body,) = engine.bodies
    assert body["stream"] is True
    assert body["rid"] != "caller-rid"
    assert len(body["rid"]) == 32


@pytest.mark.mutant_pin
async def test_a_batch_of_token_id_prompts_streams(autojump_clock: trio.testing.MockClock) -> None:
    batch = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2}}
    async with ts.open_worker(slow_sim()) as worker:
        assert await read(worker, batch, ts.RequestContext("pub")) >= 2


@pytest.mark.mutant_pin
@pytest.mark.parametrize(
    ("features", "n", "refused"),
    [({"batch_parallel_sampling": False}, 1, False), ({"batch_parallel_sampling": False}, 2, True)],
    ids=["one sample", "two samples"],
)
async def test_a_batch_needs_batch_parallel_sampling_only_for_n_above_one(
    features: dict[str, object], n: int, refused: bool, autojump_clock: trio.testing.MockClock
) -> None:
    engine = FaultyEngine(slow_sim(), Faults(), features=features)
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": n}}
    async with ts.open_worker(engine) as worker:
        if refused:
            with pytest.raises(ts.InvalidRequest, match="parallel sampling"):
                await read(worker, batch, ts.RequestContext("pub"))
        else:
            assert await read(worker, batch, ts.RequestContext("pub")) >= 2


@pytest.mark.mutant_pin
async def test_every_prompt_of_a_batch_is_aborted_when_the_close_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One task per prompt waits ``release_timeout`` (1.0), then aborts it after its dispatch."""
    sim = slow_sim()
    engine = RecordingEngine(sim, Faults(close="raise"))
    batch = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 50}}
    async with ts.open_worker(engine) as worker:
        assert await read(worker, batch, ts.RequestContext("pub"), leave_after=1) == 1
        left = trio.current_time()
        await trio.sleep(30)
    rids = engine.bodies[0]["rid"]
    assert sorted(rid for _, rid in engine.aborts) == sorted(rids)
    assert {time for time, _ in engine.aborts} == {left + 1.0}
    assert sim.live_rids() == set()


# -- bootstrap fields ----------------------------------------------------------------------------


@pytest.mark.mutant_pin
@pytest.mark.parametrize(
    ("fields", "accepted"),
    [
        pytest.param({"bootstrap_room": 0}, True, id="room-0"),
        pytest.param({"bootstrap_room": 2**63 - 1}, True, id="room-max"),
        pytest.param({"bootstrap_room": 2**63}, False, id="room-past-max"),
        pytest.param({"bootstrap_room": -1}, False, id="room-negative"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 1}, True, id="port-1"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 65535}, True, id="port-max"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 65536}, False, id="port-past-max"),
        pytest.param({"bootstrap_room": 5, "bootstrap_port": 0}, False, id="port-0"),
        # An aggregated engine needs no room.
        pytest.param({"bootstrap_host": "10.0.0.7"}, True, id="host-alone"),
    ],
)
async def test_bootstrap_values_are_checked_at_their_bounds(
    fields: dict[str, Any], accepted: bool, autojump_clock: trio.testing.MockClock
) -> None:
    async with ts.open_worker(slow_sim()) as worker:
        if accepted:
            assert await read(worker, {**HELLO, **fields}, ts.RequestContext("pub")) == 5
        else:
            with pytest.raises(ts.InvalidRequest, match="bootstrap_"):
                await read(worker, {**HELLO, **fields}, ts.RequestContext("pub"))


@pytest.mark.mutant_pin
async def test_a_batch_may_give_one_bootstrap_room_per_prompt_each_checked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}
    async with ts.open_worker(slow_sim()) as worker:
        assert await read(worker, {**batch, "bootstrap_room": [1, 2]}, ts.RequestContext("a")) >= 2
        with pytest.raises(ts.InvalidRequest, match="bootstrap_room must be an int"):
            await read(worker, {**batch, "bootstrap_room": [1, -2]}, ts.RequestContext("b"))

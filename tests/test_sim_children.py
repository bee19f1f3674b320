"""The SimEngine's children: a native batch (one rid per prompt) and parallel sampling
(``n > 1``: a fresh uuid rid per sample, named only in its first output), as SGLang 0.5.23
makes them, on the timeline of ``_sim_timeline.py``."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from _sim_timeline import (
    DISPATCH,
    DISPATCHED_AT,
    FIRST_TOKEN_AT,
    LATER,
    UUID_HEX,
    assert_idle,
    finish_reason,
    make_engine,
    normal_run,
    registered_rids,
    request,
    started,
)
from trio_sglang import SimEngine

# -- 11. native batch ----------------------------------------------------------

BATCH_RIDS = [("b", ["b_0", "b_1"]), (["x", "y"], ["x", "y"])]


@pytest.mark.parametrize(("rid", "rids"), BATCH_RIDS)
async def test_native_batch_runs_each_prompt(
    rid: str | list[str], rids: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request(rid, ["a b", "c d e"], max_new_tokens=2)))
        await trio.testing.wait_all_tasks_blocked()
        assert set(engine.tokenizer_manager.rid_to_state) == set(rids)
    assert registered_rids(engine) == rids
    assert h.timeline(rids[0]) == normal_run(2)
    assert h.timeline(rids[1]) == normal_run(2, dispatched_at=DISPATCHED_AT + DISPATCH)
    for index, child in enumerate(rids):
        outs = [out for out in pulled.outputs if out["index"] == index]
        assert [out["meta_info"]["id"] for out in outs] == [child, child]
        assert [out["meta_info"]["prompt_tokens"] for out in outs] == [2 + index] * 2
        assert [finish_reason(out) for out in outs] == [None, {"type": "length", "length": 2}]
    assert len(pulled.outputs) == 4
    assert pulled.ended_at == 3.5
    assert_idle(engine)


@pytest.mark.parametrize(("rid", "rids"), BATCH_RIDS)
async def test_closing_a_native_batch_aborts_every_prompt(
    rid: str | list[str], rids: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        stream = engine.generate(request(rid, ["a b", "c d e"], max_new_tokens=2))
        first = await stream.__anext__()
        assert first["index"] == 0
        assert h.now() == FIRST_TOKEN_AT
        await stream.aclose()
        assert_idle(engine)
        await h.at(LATER)
    aborted = [(2.5, "abort_requested"), (2.5, "abort_applied")]
    assert h.timeline(rids[0]) == [*normal_run(2)[:3], *aborted]
    assert h.timeline(rids[1]) == [(0.0, "registered"), (2.0, "dispatched"), *aborted]


# -- 12. n > 1 -----------------------------------------------------------------

PARENTS = ["p_0", "p_1", "p_2"]


def split_parallel(engine: SimEngine) -> tuple[str, list[str]]:
    """The warm-up rid and the child rids, checking the rid_i states came first."""
    rids = registered_rids(engine)
    assert rids[:3] == PARENTS
    warm_up, *children = rids[3:]
    assert len(children) == 3
    for rid in [warm_up, *children]:
        assert UUID_HEX.fullmatch(rid), rid
        assert not rid.startswith("p")
    assert len(set(children)) == 3
    return warm_up, children


async def test_parallel_sampling_uses_fresh_uuid_children(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine(dispatch_delay=0.0)
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request("p", "hi", n=3, max_new_tokens=2)))
        await h.at(0.5)
        assert set(engine.tokenizer_manager.rid_to_state) == set(PARENTS)
        await h.at(3.25)  # every child decoding
        await engine.abort("p")  # the caller's rid is unknown to the engine
    warm_up, children = split_parallel(engine)
    for parent in PARENTS:
        assert h.timeline(parent) == [(0.0, "registered"), (2.0, "released")]
    assert h.timeline(warm_up) == [(1.0, "registered"), (1.0, "dispatched"), (2.0, "finished")]
    trace = list(engine.trace)
    warm_up_done = trace.index(engine.trace.of(warm_up)[-1])
    assert all(trace.index(engine.trace.of(child)[1]) > warm_up_done for child in children)
    for child in children:
        assert h.timeline(child) == [
            (2.0, "registered"),
            (2.0, "dispatched"),
            (3.0, "token"),
            (3.5, "token"),
            (3.5, "finished"),
        ]
    assert [(e.kind, e.detail) for e in engine.trace.of("p")] == [("abort_dropped", "unknown rid")]
    assert not any(e.kind == "abort_lost" for e in engine.trace)
    for index, child in enumerate(children):
        outs = [out for out in pulled.outputs if out["index"] == index]
        assert [out["meta_info"]["id"] for out in outs] == [child, child]
        assert finish_reason(outs[-1]) == {"type": "length", "length": 2}
    assert len(pulled.outputs) == 6
    assert_idle(engine)


async def test_closing_parallel_sampling_stops_every_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine(dispatch_delay=0.0)
    async with started(engine) as h:
        stream = engine.generate(request("p", "hi", n=3, max_new_tokens=2))
        await stream.__anext__()
        assert h.now() == 3.0
        await stream.aclose()
        assert_idle(engine)
        await h.at(LATER)
    _, children = split_parallel(engine)
    for child in children:
        assert h.timeline(child) == [
            (2.0, "registered"),
            (2.0, "dispatched"),
            (3.0, "token"),
            (3.0, "abort_requested"),
            (3.0, "abort_applied"),
        ]


async def test_cancel_between_children_aborts_dispatched_and_releases_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()  # children dispatched at 2.5, 3.0, 3.5
    async with started(engine) as h:
        stream = engine.generate(request("p", "hi", n=3, max_new_tokens=2))
        with trio.move_on_after(2.75):
            await stream.__anext__()
        assert_idle(engine)
        await h.at(LATER)
    _, (sent, *unsent) = split_parallel(engine)
    assert h.timeline(sent) == [
        (2.0, "registered"),
        (2.5, "dispatched"),
        (2.75, "abort_requested"),
        (2.75, "abort_applied"),
    ]
    for child in unsent:
        assert h.timeline(child) == [(2.0, "registered"), (2.75, "released")]

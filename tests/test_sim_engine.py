"""The SimEngine on its own: it must reproduce SGLang 0.5.23's request and abort semantics.

Each test drives ``SimEngine`` directly (no worker) on trio's ``MockClock`` and
judges it from its trace, its registry and what the stream yields. Together
they prove that the model keeps SGLang's traps (a lazy stream, an abort lost
before dispatch and blocking every later abort, prefix matching, no
tombstone, the leak of an abandoned stream, fresh uuid rids for ``n > 1``)
and SGLang's one reliable way out (closing or cancelling the stream runs the
release path), at exact clock times.

Default timeline (seconds after the first pull, ``make_engine()``): registered
at 0, tokenized until 1, dispatched at 1.5, tokens at 2.5, 3.0, 3.5 ... (one
every 0.5 s); a three-token request finishes at 3.5.
"""

from __future__ import annotations

import math
from contextlib import suppress
from typing import Any

import pytest
import trio
import trio.testing

from _sim_timeline import (
    ABORTS,
    DISPATCHED_AT,
    FIRST_TOKEN_AT,
    INTERVAL,
    KNOBS,
    LATER,
    Harness,
    Pulled,
    Timeline,
    assert_idle,
    finish_reason,
    make_engine,
    normal_run,
    request,
    started,
)
from trio_sglang import RequestPhase, SimEngine

# -- 1. lazy start -------------------------------------------------------------


async def test_stream_starts_nothing_until_first_pull(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        stream = engine.generate(request("r1"))
        await h.at(5.0)
        assert engine.trace == []
        assert engine.phase("r1") is RequestPhase.ABSENT
        assert_idle(engine)
        pulled = h.consume(stream, limit=1)
        await trio.testing.wait_all_tasks_blocked()
        assert h.timeline("r1") == [(5.0, "registered")]
        assert engine.phase("r1") is RequestPhase.REGISTERED
    assert pulled.times == [5.0 + FIRST_TOKEN_AT]


async def test_closing_an_unstarted_stream_touches_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        stream = engine.generate(request("r1"))
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await h.at(LATER)
    assert engine.trace == []
    assert_idle(engine)


# -- 2. a normal run -----------------------------------------------------------


async def test_normal_run_timeline_and_outputs(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request("r1")))
    assert h.timeline("r1") == normal_run()
    assert pulled.times == [2.5, 3.0, 3.5]
    assert pulled.ended_at == 3.5
    for count, out in enumerate(pulled.outputs, start=1):
        assert "index" not in out
        assert len(out["output_ids"]) == 1
        assert isinstance(out["output_ids"][0], int)
        assert out["text"].startswith(" ")
        assert len(out["text"].split()) == 1
        meta = out["meta_info"]
        assert meta["id"] == "r1"
        assert meta["prompt_tokens"] == 2  # "hello world"
        assert meta["completion_tokens"] == count
    assert [finish_reason(out) for out in pulled.outputs] == [
        None,
        None,
        {"type": "length", "length": 3},
    ]
    assert engine.phase("r1") is RequestPhase.ABSENT
    assert_idle(engine)


# -- 3, 4, 6. aborts by rid ----------------------------------------------------


async def test_abort_during_tokenization_is_lost_and_blocks_later_aborts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request("r1")))
        await h.at(0.5)
        assert engine.phase("r1") is RequestPhase.REGISTERED
        await engine.abort("r1")
        await h.at(2.0)
        assert engine.phase("r1") is RequestPhase.DISPATCHED
        await engine.abort("r1")
    assert h.timeline("r1") == [
        (0.0, "registered"),
        (0.5, "abort_requested"),
        (0.5, "abort_lost"),
        (1.5, "dispatched"),
        (2.0, "abort_dropped"),
        (2.5, "token"),
        (3.0, "token"),
        (3.5, "token"),
        (3.5, "finished"),
    ]
    assert [e.detail for e in engine.trace.of("r1") if e.kind == "abort_dropped"] == [
        "abort already sent"
    ]
    assert len(pulled.outputs) == 3
    assert finish_reason(pulled.outputs[-1]) == {"type": "length", "length": 3}
    assert_idle(engine)


async def test_second_abort_of_a_dispatched_rid_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request("r1")))
        await h.at(2.0)
        await engine.abort("r1")
        await engine.abort("r1")
    assert h.timeline("r1") == [
        (0.0, "registered"),
        (1.5, "dispatched"),
        (2.0, "abort_requested"),
        (2.0, "abort_applied"),
        (2.0, "abort_dropped"),
    ]
    assert pulled.times == [2.0]
    assert finish_reason(pulled.outputs[0])["type"] == "abort"
    assert pulled.ended_at == 2.0
    assert_idle(engine)


async def test_abort_of_an_unknown_rid_never_reaches_the_scheduler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine):
        await engine.abort("nobody")
    assert [(e.kind, e.rid, e.detail) for e in engine.trace] == [
        ("abort_dropped", "nobody", "unknown rid")
    ]


async def test_scheduler_keeps_no_tombstone(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request("r1")))
        await h.at(0.5)
        engine.tokenizer_manager.scheduler.abort("r1")  # it reaches the scheduler first
    assert h.timeline("r1") == [(0.0, "registered"), (0.5, "abort_lost"), *normal_run()[1:]]
    assert finish_reason(pulled.outputs[-1]) == {"type": "length", "length": 3}
    assert_idle(engine)


# -- 5. prefix matching --------------------------------------------------------


async def test_abort_matches_by_prefix(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    async with started(engine) as h:
        r1 = h.consume(engine.generate(request("r1")))
        r10 = h.consume(engine.generate(request("r10")))
        await h.at(2.75)  # both decoding, one token each
        await engine.abort("r1")
    aborted = [(2.75, "abort_applied")]
    assert h.timeline("r1") == [*normal_run()[:3], (2.75, "abort_requested"), *aborted]
    assert h.timeline("r10") == [*normal_run()[:3], *aborted]
    for pulled in (r1, r10):
        assert pulled.times == [2.5, 2.75]
        assert finish_reason(pulled.outputs[-1])["type"] == "abort"
        assert pulled.ended_at == 2.75
    assert r10.outputs[-1]["meta_info"]["id"] == "r10"
    assert_idle(engine)


# -- 7. the release path -------------------------------------------------------


#: When the first pull is cancelled, and the timeline.
CANCELLED_PULLS = [
    pytest.param(0.5, [(0.0, "registered"), (0.5, "released")], id="during-tokenization-releases"),
    pytest.param(
        2.0,
        [*normal_run()[:2], (2.0, "abort_requested"), (2.0, "abort_applied")],
        id="after-dispatch-aborts",
    ),
]


@pytest.mark.parametrize(("cancel_at", "expected"), CANCELLED_PULLS)
async def test_cancelled_pull(
    cancel_at: float, expected: Timeline, autojump_clock: trio.testing.MockClock
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        stream = engine.generate(request("r1"))
        with trio.move_on_after(cancel_at) as scope:
            await stream.__anext__()
        assert scope.cancelled_caught
        assert engine.phase("r1") is RequestPhase.ABSENT
        assert_idle(engine)
        await h.at(LATER)
    assert h.timeline("r1") == expected
    assert len(engine.trace) == len(expected)  # nothing for any other rid either
    assert_idle(engine)


#: Outputs pulled, the last one's finish reason, when the stream is closed, the timeline.
ACLOSES = [
    pytest.param(
        1,
        None,
        2.75,  # parked between items
        [*normal_run()[:3], (2.75, "abort_requested"), (2.75, "abort_applied")],
        id="mid-stream-aborts",
    ),
    pytest.param(
        3,
        {"type": "length", "length": 3},
        4.0,
        normal_run(),
        id="after-the-final-output-sends-nothing",
    ),
]


@pytest.mark.parametrize(("outputs", "last_reason", "close_at", "expected"), ACLOSES)
async def test_aclose(
    outputs: int,
    last_reason: dict[str, Any] | None,
    close_at: float,
    expected: Timeline,
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        stream = engine.generate(request("r1"))
        pulled = Pulled()
        await h.pull(stream, pulled, limit=outputs)
        assert len(pulled.outputs) == outputs
        assert finish_reason(pulled.outputs[-1]) == last_reason
        await h.at(close_at)
        await stream.aclose()
        assert_idle(engine)
        await h.at(LATER)
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    assert h.timeline("r1") == expected
    sent = [kind for _, kind in expected if kind in ABORTS]
    assert [event.kind for event in engine.trace if event.kind in ABORTS] == sent


# -- 8. the leak of an abandoned stream ----------------------------------------


async def test_abandoned_stream_keeps_decoding(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    async with started(engine) as h:
        stream = engine.generate(request("r1", max_new_tokens=5))
        await stream.__anext__()  # then the consumer walks away without aclose
        await h.at(3.25)
        assert engine.phase("r1") is RequestPhase.DISPATCHED
        assert engine.live_rids() == {"r1"}
        await h.at(LATER)
        assert h.timeline("r1") == normal_run(max_new_tokens=5)
        assert_idle(engine)
        rest = [out async for out in stream]  # the outputs were produced all along
    # ... and the backlog comes as one output, as SGLang's TokenizerManager hands it over.
    assert [len(out["output_ids"]) for out in rest] == [4]
    assert finish_reason(rest[-1]) == {"type": "length", "length": 5}


# -- 9. phases -----------------------------------------------------------------


async def test_phase_and_wait_phase_change(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    seen: list[tuple[float, RequestPhase]] = []

    async def watch(h: Harness) -> None:
        phase = RequestPhase.ABSENT
        while len(seen) < 3:
            phase = await engine.wait_phase_change("r1", phase)
            seen.append((h.now(), phase))

    async with started(engine) as h:
        h.nursery.start_soon(watch, h)
        await h.at(0.5)
        assert engine.phase("r1") is RequestPhase.ABSENT
        h.consume(engine.generate(request("r1")))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.phase("r1") is RequestPhase.REGISTERED
        assert await engine.wait_phase_change("r1", RequestPhase.REGISTERED) is (
            RequestPhase.DISPATCHED
        )
        assert h.now() == 0.5 + DISPATCHED_AT
        assert engine.phase("r1") is RequestPhase.DISPATCHED
        # An unchanged phase returns at once.
        assert await engine.wait_phase_change("r1", RequestPhase.ABSENT) is (
            RequestPhase.DISPATCHED
        )
        assert h.now() == 0.5 + DISPATCHED_AT
    assert seen == [
        (0.5, RequestPhase.REGISTERED),
        (2.0, RequestPhase.DISPATCHED),
        (4.0, RequestPhase.ABSENT),
    ]
    assert engine.phase("r1") is RequestPhase.ABSENT


# -- 10. duplicate rid ---------------------------------------------------------


async def test_duplicate_rid_raises_and_leaves_the_first_intact(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = make_engine()
    async with started(engine) as h:
        first = h.consume(engine.generate(request("r1")))
        await h.at(0.5)
        state = engine.tokenizer_manager.rid_to_state["r1"]
        with pytest.raises(ValueError, match="r1"):
            await engine.generate(request("r1", text="other prompt")).__anext__()
        assert engine.tokenizer_manager.rid_to_state["r1"] is state
        assert engine.phase("r1") is RequestPhase.REGISTERED
    assert h.timeline("r1") == normal_run()
    assert finish_reason(first.outputs[-1]) == {"type": "length", "length": 3}
    assert_idle(engine)


# -- 13. engine not running ----------------------------------------------------


async def test_pull_outside_running_raises(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    stream = engine.generate(request("r1"))
    with pytest.raises(trio.ClosedResourceError):
        await stream.__anext__()
    assert engine.trace == []
    assert_idle(engine)


async def test_running_twice_at_once_raises(autojump_clock: trio.testing.MockClock) -> None:
    engine = make_engine()
    async with engine.running():
        with pytest.raises(RuntimeError, match="already running"):
            async with engine.running():
                pass  # pragma: no cover


# -- 14. timing knobs ----------------------------------------------------------


@pytest.mark.parametrize("value", [-1.0, -1e-9, math.nan, math.inf, -math.inf, True, False, "1"])
@pytest.mark.parametrize("knob", KNOBS)
async def test_bad_timing_knob_raises(
    knob: str, value: Any, autojump_clock: trio.testing.MockClock
) -> None:
    with pytest.raises(ValueError, match=knob):
        make_engine(**{knob: value})


@pytest.mark.parametrize("knob", KNOBS)
async def test_zero_and_integer_timing_knobs_are_accepted(
    knob: str, autojump_clock: trio.testing.MockClock
) -> None:
    assert getattr(make_engine(**{knob: 0}).timing, knob) == 0
    assert getattr(make_engine(**{knob: 2}).timing, knob) == 2


# -- divergences from SGLang: these fail until the SimEngine is fixed ------------


@pytest.mark.parametrize("rid", [["x"], ["x", "y", "z"]], ids=["too_short", "too_long"])
async def test_rid_list_must_match_the_batch_length(
    rid: list[str], autojump_clock: trio.testing.MockClock
) -> None:
    """SGLang's ``_normalize_rid`` raises ValueError before registering anything."""
    engine = make_engine()
    async with started(engine):
        stream = engine.generate(request(rid, ["a b", "c d e"]))
        with pytest.raises(ValueError, match="length"):
            await stream.__anext__()
    assert engine.trace == []
    assert_idle(engine)


@pytest.mark.parametrize("close_at", [0.5, 2.0], ids=["tokenizing", "dispatched"])
async def test_aclose_during_another_tasks_pull(
    close_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    """SGLang's generator refuses ``aclose`` while a pull runs (RuntimeError).

    Whether the model refuses too or closes the stream, a released request must
    never reach the scheduler, and the pull in progress must not hang.
    """
    engine = make_engine()
    pull_ended: list[float] = []
    async with started(engine) as h:
        stream = engine.generate(request("r1"))

        async def pull() -> None:
            with suppress(trio.ClosedResourceError):
                await h.pull(stream, Pulled())
            pull_ended.append(h.now())

        h.nursery.start_soon(pull)
        await h.at(close_at)
        with suppress(RuntimeError):
            await stream.aclose()
        await h.at(LATER)
        h.nursery.cancel_scope.cancel()  # a hung pull must not hang the test
    kinds = engine.trace.kinds("r1")
    if "released" in kinds:
        assert "dispatched" not in kinds[kinds.index("released") :], h.timeline("r1")
    assert pull_ended, "the pull in progress never ended"
    assert_idle(engine)


async def test_the_prefix_cache_keeps_no_salt_it_was_given(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without this rule it kept each ``cache_salt`` whole: 300 salts of 1 MB pinned 300 MB."""
    import gc
    import tracemalloc

    engine = SimEngine(keep_trace=False)  # as serve runs it
    tracemalloc.start()
    try:
        async with engine.running():
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            for i in range(20):
                salt = f"{i:08}" + "s" * (1 << 20)
                stream = engine.generate({**request(f"salted-{i}"), "cache_salt": salt})
                async for _ in stream:
                    pass
                del salt, stream
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, f"{held} bytes held after 20 salts of 1 MB"


# -- the trace: read as a list, costing the collector nothing -----------------------


async def test_the_trace_reads_as_a_list_of_events(autojump_clock: trio.testing.MockClock) -> None:
    from trio_sglang.sim import Trace, TraceEvent

    trace = Trace()
    assert trace == []
    assert len(trace) == 0
    trace.record("registered", "a")
    await trio.sleep(1.0)
    trace.record("abort_dropped", "b", "unknown rid")
    trace.record("released", "a")
    start = trio.current_time() - 1.0
    expected = [
        TraceEvent(start, "registered", "a"),
        TraceEvent(start + 1.0, "abort_dropped", "b", "unknown rid"),
        TraceEvent(start + 1.0, "released", "a"),
    ]
    assert trace == expected
    assert list(trace) == expected
    assert trace[-1] == expected[-1]
    assert trace[1].detail == "unknown rid"
    assert trace[1:] == expected[1:]
    assert isinstance(trace[1:], list)
    assert trace.of("a") == [expected[0], expected[2]]
    assert trace.kinds("a") == ["registered", "released"]
    assert trace.counts == {"registered": 1, "abort_dropped": 1, "released": 1}
    assert trace != expected[:2]
    assert trace != "not a trace"
    counts_only = Trace(keep_events=False)
    counts_only.record("token", "a")
    assert counts_only == []
    assert counts_only.counts["token"] == 1


async def test_the_trace_keeps_no_object_per_event() -> None:
    import gc

    from trio_sglang.sim import Trace, TraceEvent

    def events_alive() -> int:
        return sum(isinstance(obj, TraceEvent) for obj in gc.get_objects())

    trace = Trace()
    before = events_alive()
    for index in range(1000):
        trace.record("token", f"rid-{index % 10}")
    # A thousand events, and not one object the collector tracks for them: the
    # kinds and rids are the callers' strings, the times plain floats.
    assert len(trace) == 1000
    assert events_alive() == before


# -- a scheduler that falls behind ----------------------------------------------------


async def test_a_request_that_fell_behind_its_cadence_is_not_owed_what_it_missed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A decode step gives each running request one token, however late it runs.

    When the process falls behind (more requests than it decodes for), each pass
    of the scheduler steps every due request once and yields: without this rule it
    stepped a late request for every interval it had missed, all without a
    checkpoint, and thousands of requests at a short interval froze the process.
    """
    engine = make_engine()
    async with started(engine) as h:
        pulled = h.consume(engine.generate(request("r1", max_new_tokens=100)), limit=1)
        await h.at(FIRST_TOKEN_AT)
        await trio.testing.wait_all_tasks_blocked()
        assert len(pulled.outputs) == 1
        autojump_clock.autojump_threshold = math.inf
        autojump_clock.jump(50 * INTERVAL)  # as if the process had not run for 25 s
        await trio.testing.wait_all_tasks_blocked()
        late = [t for t, kind in h.timeline("r1") if kind == "token" and t > FIRST_TOKEN_AT]
        assert late == [FIRST_TOKEN_AT + 50 * INTERVAL] * 2  # caught up, nothing owed
        autojump_clock.autojump_threshold = 0
        await h.at(FIRST_TOKEN_AT + 52.5 * INTERVAL)
        late = [t for t, kind in h.timeline("r1") if kind == "token" and t > FIRST_TOKEN_AT]
        assert late[2:] == [FIRST_TOKEN_AT + 51 * INTERVAL, FIRST_TOKEN_AT + 52 * INTERVAL]
        h.nursery.cancel_scope.cancel()

"""Property-based lifecycle tests: random shapes, timings, cancels and shutdowns.

The matrix tests replay the moments we thought of, one request at a time.
Here hypothesis draws whole examples (``_strategies.Scenario``): up to eight
requests sent at once to one ``SimEngine``, each with its own shape (output
mode, one prompt or a native batch, ``n``, caller rids, ``max_new_tokens``),
consumer pace, way of leaving (stop, kill, break, aclose from the consumer or
from another task, an exception in the block, the consumer's task cancelled,
its own deadline, or none) and moment, under random engine timings, and
sometimes a worker shutdown at a random moment. Each example runs in its own
``trio.run`` on a fresh ``MockClock``, so it is exact, independent and fast.

Every example is judged against the lifecycle's contract, from the
engine's trace and from what each consumer saw:

- no abort is lost, and none is sent for a rid before that rid's dispatch;
  only cancelled requests are aborted, one sample exactly at its cancel or
  at its dispatch if later;
- the caller's block exits at the clock time of its cancel (for break, aclose
  and exceptions, of the consumer's own decision); aclose from another task
  while the consumer works ends the stream at the consumer's next pull;
- a stream still open when the worker is left gets ``EngineShutdown`` then;
  a request that arrives after that gets it too and reaches nothing;
- a request cancelled before its first pull reaches nothing at the engine;
- only public ids are seen (no engine id in any chunk; text chunks carry the
  public id; native chunks carry the child's public id), and a request read
  to its end got every token of every child exactly once;
- leaving the worker takes at most ``shutdown_grace + close_timeout``, leaves
  no open stream, no pending cleanup and no task touching the engine.

With a grace longer than any cleanup's bound (``test_lifecycle_fuzz``) also:
nothing is live at the engine afterwards, no bound of the policy is hit (no
warning is logged), and each engine id decodes at most one token after its
request's cancel, short of two limits that are SGLang's and not the
lifecycle's (see ``check_late_tokens``). ``test_shutdown_fuzz`` cuts cleanup
short with a small grace and checks what must hold even then.

One example's run (its consumers, cancels and shutdown, on a recording
SimEngine) is ``_lifecycle_examples.py``. Falsifying examples found so far
are written out at the end of this file as plain regression tests
(``test_regression_*``).

Budget: CI runs a fixed, derandomized ``CI_EXAMPLES`` examples. With
``TRIO_SGLANG_FUZZ_EXAMPLES=N`` set, the tests run N examples between them
from a fresh random seed (a failure prints a reproduction blob) and print
what they covered at the end of the session::

    TRIO_SGLANG_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz_lifecycle.py -q \\
        --hypothesis-show-statistics
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import event, given, settings

import trio_sglang as ts
from _fuzz import FUZZ_ENV, fuzz_settings
from _lifecycle_examples import (
    ConsumerError,
    Outcome,
    Seen,
    engine_states,
    run,
)
from _strategies import (
    LONG_GRACE,
    EnginePlan,
    Scenario,
    scenarios,
)
from conftest import finish_reason, slow_sim

#: Examples per test in CI: fixed, derandomized, at least 1,000 in all.
CI_EXAMPLES = {"test_lifecycle_fuzz": 1000, "test_shutdown_fuzz": 250}
#: Bounds that no cleanup in these examples can reach: the slowest
#: no-release ``n > 1`` request has its last child speak about 17 s after an
#: early cancel (child watch), its cleanup then closes and aborts (cleanup
#: bound), and the grace outlasts every cleanup, so nothing is cut short.
LONG_POLICY = ts.AbortPolicy(
    shutdown_grace=LONG_GRACE, child_watch_timeout=30.0, cleanup_timeout=45.0
)
#: Every engine id (minted rids, ``rid_i``, SGLang's child uuids) holds 32
#: hex digits, and nothing public does: no chunk may contain such a run.
HEX32 = re.compile(r"[0-9a-f]{32}")


def settings_for(test_name: str) -> settings:
    return fuzz_settings(CI_EXAMPLES, test_name)


# -- invariants ----------------------------------------------------------------


def check_aborts_ordered(trace: list[ts.TraceEvent]) -> None:
    """No abort lost, none sent for a rid before that rid's dispatch."""
    dispatched: set[str] = set()
    for event_ in trace:
        assert event_.kind != "abort_lost", event_
        if event_.kind == "dispatched":
            dispatched.add(event_.rid)
        elif event_.kind == "abort_requested":
            assert event_.rid in dispatched, f"abort before dispatch: {event_}"


def check_worker_exit(outcome: Outcome, policy: ts.AbortPolicy) -> None:
    """Leaving the worker took at most the policy's bound and left nothing behind."""
    assert outcome.open_streams_after == 0
    assert outcome.pending_cleanups_after == 0
    took = outcome.worker_done_at - outcome.left_worker_at
    assert took <= policy.shutdown_grace + policy.close_timeout, took
    # Nothing of the worker's is left running: the engine saw nothing after.
    assert len(outcome.engine.trace) == outcome.trace_length_at_exit


def same_instant(a: float, b: float) -> bool:
    """Equal clock times: MockClock's autojump lands on a deadline up to float rounding."""
    return math.isclose(a, b, rel_tol=0.0, abs_tol=1e-9)


def check_exit(seen: Seen, left_worker_at: float) -> None:
    """The block exited when it had to, with the right exception."""
    assert seen.left_at is not None
    if seen.expect_left_at is not None:
        assert same_instant(seen.left_at, seen.expect_left_at), (seen.left_at, seen.expect_left_at)
    if seen.open_at_shutdown:
        # Unless the consumer itself went in that same instant.
        assert isinstance(seen.raised, ts.EngineShutdown) or seen.cancelled_at == left_worker_at
    elif isinstance(seen.raised, ts.EngineShutdown):  # refused: it came after the shutdown
        assert seen.engine_stream is None
        assert seen.started_at >= left_worker_at
        assert seen.left_at == seen.started_at
    if seen.plan.method == "raise" and seen.left_by_choice:
        assert isinstance(seen.raised, ConsumerError)
    if isinstance(seen.raised, ConsumerError):
        assert seen.left_by_choice
    if seen.cancel_state in ("before_open", "before_pull"):
        assert engine_states(seen.engine_stream) == []  # the engine never heard of it
    assert seen.chunks_after_aclose == []


def chunk_index(chunk: dict[str, Any], output: ts.OutputMode) -> int:
    if output == "text":
        return int(chunk["choices"][0]["index"])
    return int(chunk.get("index", 0))


def chunk_tokens(chunk: dict[str, Any], output: ts.OutputMode) -> int:
    if output == "tokens":
        return len(chunk["token_ids"])
    if output == "native":
        return len(chunk["output_ids"])
    return len(chunk["choices"][0]["text"].split())  # one word per token


def check_chunks(seen: Seen) -> None:
    """Public ids only; and a request read to its end got all of every child, once."""
    plan, output = seen.plan, seen.plan.output
    names = plan.public_child_ids()
    tokens: Counter[int] = Counter()
    finals: Counter[int] = Counter()
    for chunk in seen.chunks:
        assert not HEX32.search(repr(chunk)), chunk
        index = chunk_index(chunk, output)
        assert 0 <= index < plan.children, chunk
        if output == "tokens":
            assert set(chunk) == {"index", "token_ids", "finish_reason"}, chunk
        elif output == "text":
            assert chunk["id"] == plan.public_id, chunk
            assert len(chunk["choices"]) == 1, chunk
        else:
            assert chunk["meta_info"]["id"] == names[index], (chunk, names)
        assert not finals[index], f"a chunk after child {index} finished: {chunk}"
        tokens[index] += chunk_tokens(chunk, output)
        if finish_reason(chunk, output) is not None:
            finals[index] += 1
    if seen.complete:
        every_child = range(plan.children)
        assert finals == Counter(every_child), finals
        assert tokens == Counter(
            {k: plan.max_new_for(k) for k in every_child if plan.max_new_for(k)}
        )
        for chunk in seen.chunks:
            assert finish_reason(chunk, output) in (None, "length"), chunk


def check_late_tokens(outcome: Outcome, engine: EnginePlan) -> None:
    """Each engine id decodes at most one token (one instant's worth) after its cancel.

    Two limits are the engine's, not the lifecycle's. With ``token_interval``
    zero the SimEngine decodes a whole request in one instant, so there at
    most one instant's worth. And on an engine whose close releases nothing,
    a child of an ``n > 1`` request can only be aborted once its id is known,
    from its first output, and SGLang yields no output before it has sent
    every child: so for those children the count starts when the last one
    was dispatched (or never, if not all were).
    """
    tokens: defaultdict[str, list[tuple[int, float]]] = defaultdict(list)
    dispatched: dict[str, float] = {}
    for position, event_ in enumerate(outcome.engine.trace):
        if event_.kind == "token":
            tokens[event_.rid].append((position, event_.time))
        elif event_.kind == "dispatched":
            dispatched[event_.rid] = event_.time
    for seen in outcome.seen:
        if seen.cancel_mark is None:
            continue
        states = engine_states(seen.engine_stream)
        visible_from = -math.inf
        if seen.plan.n > 1 and not engine.release_on_close:
            # Children, not the warm-up (no index) nor the rid_i placeholders (never sent).
            sent = [
                dispatched[s.rid] for s in states if s.index is not None and s.rid in dispatched
            ]
            visible_from = max(sent) if len(sent) == seen.plan.children else math.inf
        for state in states:
            late = [
                t
                for position, t in tokens[state.rid]
                if position >= seen.cancel_mark and t >= visible_from
            ]
            if engine.token_interval > 0:
                assert len(late) <= 1, (state.rid, late, seen)
            else:
                assert len(set(late)) <= 1, (state.rid, late, seen)


def check_abort_timing(outcome: Outcome) -> None:
    """Only cancelled requests are aborted; one sample the moment it may be.

    For ``n == 1`` that is exactly at the cancel, or at the rid's dispatch
    if that came later (woken, not polled: no backoff). Children of ``n > 1``
    are aborted when first seen, which the engine decides.
    """
    dispatched: dict[str, float] = {}
    aborted: defaultdict[str, list[float]] = defaultdict(list)
    for event_ in outcome.engine.trace:
        if event_.kind == "dispatched":
            dispatched[event_.rid] = event_.time
        elif event_.kind == "abort_requested":
            aborted[event_.rid].append(event_.time)
    for seen in outcome.seen:
        for state in engine_states(seen.engine_stream):
            times = aborted[state.rid]
            if seen.cancelled_at is None:
                assert times == [], (state.rid, seen)
            elif seen.plan.n == 1:
                due = max(seen.cancelled_at, dispatched[state.rid]) if times else None
                assert times in ([], [due]), (state.rid, times, due, seen)


def check_invariants(
    scenario: Scenario, outcome: Outcome, policy: ts.AbortPolicy, *, generous: bool
) -> None:
    """Every invariant of the module docstring; ``generous``: the grace cut nothing short."""
    engine = outcome.engine
    check_aborts_ordered(engine.trace)
    check_worker_exit(outcome, policy)
    check_abort_timing(outcome)
    for seen in outcome.seen:
        check_exit(seen, outcome.left_worker_at)
        check_chunks(seen)
    assert all(HEX32.search(event_.rid) for event_ in engine.trace)  # HEX32 covers every id
    if generous:
        assert engine.live_rids() == set()
        assert outcome.warnings == []
        check_late_tokens(outcome, scenario.engine)


# -- coverage ------------------------------------------------------------------


def engine_phase(seen: Seen, trace: list[ts.TraceEvent]) -> str:
    """Where the request was at the engine when it was cancelled (for coverage)."""
    if seen.cancel_mark is None:
        return "uncancelled"
    if seen.cancel_state in ("before_open", "before_pull"):
        return seen.cancel_state
    plan = seen.plan
    states = engine_states(seen.engine_stream)
    warm_up = {s.rid for s in states if s.index is None and plan.n > 1}
    rids = {s.rid for s in states}
    before = [e for e in trace[: seen.cancel_mark] if e.rid in rids]
    dispatched = {e.rid for e in before if e.kind == "dispatched"}
    ended = {e.rid for e in before if e.kind in ("finished", "abort_applied")} - warm_up
    if not before:
        return "unregistered"
    if not dispatched - warm_up:
        return "warm_up" if dispatched else "tokenizing"
    if len(dispatched - warm_up) < plan.children:
        return "dispatching"
    if len(ended) == plan.children:
        return "finished"
    if ended or any(e.kind == "token" for e in before):
        return "streaming"
    return "queued"


#: Engine phases in lifecycle order (see ``engine_phase``), for the tables' columns.
PHASES = (
    "before_open",
    "before_pull",
    "unregistered",
    "tokenizing",
    "warm_up",
    "dispatching",
    "queued",
    "streaming",
    "finished",
    "uncancelled",
)


@dataclass
class Coverage:
    """What the fuzz examples hit, summed over the session (hypothesis's own replays too)."""

    examples: Counter[str] = field(default_factory=Counter)
    engine_events: Counter[str] = field(default_factory=Counter)
    #: Requests by (shape, output, how they ended, engine phase then, consumer state then).
    requests: Counter[tuple[str, str, str, str, str]] = field(default_factory=Counter)

    def record(self, test: str, scenario: Scenario, outcome: Outcome) -> None:
        self.examples[test] += 1
        self.examples["release_on_close" if scenario.engine.release_on_close else "no_release"] += 1
        open_at_shutdown = sum(seen.open_at_shutdown for seen in outcome.seen)
        if open_at_shutdown:
            self.examples["shutdown with streams open"] += 1
            self.engine_events["streams ended by shutdown"] += open_at_shutdown
        self.engine_events.update(e.kind for e in outcome.engine.trace)
        for seen in outcome.seen:
            plan = seen.plan
            phase = engine_phase(seen, outcome.engine.trace)
            method = "shutdown" if seen.open_at_shutdown else plan.method
            state = seen.cancel_state or "-"
            self.requests[plan.shape, plan.output, method, phase, state] += 1
            event(f"{plan.shape}: {method} at {phase}")

    def render(self) -> list[str]:
        def by(row: int, column: int) -> Counter[tuple[str, str]]:
            counts: Counter[tuple[str, str]] = Counter()
            for key, count in self.requests.items():
                counts[key[row], key[column]] += count
            return counts

        cells = {(shape, method, phase) for shape, _, method, phase, _ in self.requests}
        lines = [
            "examples: " + ", ".join(f"{k} {v}" for k, v in sorted(self.examples.items())),
            "engine events: "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.engine_events.items())),
            f"requests: {self.requests.total()}, "
            f"distinct (shape, way out, engine phase) cells hit: {len(cells)}",
        ]
        lines += _table("requests by way out x engine phase at the cancel", by(2, 3), PHASES)
        lines += _table("requests by shape x engine phase at the cancel", by(0, 3), PHASES)
        lines += _table("requests by way out x consumer state at the cancel", by(2, 4))
        lines += _table("requests by shape x output", by(0, 1))
        return lines


def _table(title: str, counts: Counter[tuple[str, str]], order: tuple[str, ...] = ()) -> list[str]:
    rows = sorted({r for r, _ in counts})
    seen_columns = {c for _, c in counts}
    columns = [c for c in order if c in seen_columns] + sorted(seen_columns - set(order))
    width = max(len(r) for r in rows)
    lines = ["", f"{title}:", " " * width + "".join(f" {c:>{max(len(c), 5)}}" for c in columns)]
    for row in rows:
        lines.append(
            row.ljust(width) + "".join(f" {counts[row, c]:>{max(len(c), 5)}}" for c in columns)
        )
    return lines


COVERAGE = Coverage()


class _CoverageReport:
    """A pytest plugin, registered only for long runs, that prints ``COVERAGE`` at the end."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_sep("=", "trio-sglang lifecycle fuzz: what was covered")
        for line in COVERAGE.render():
            terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def _report_coverage(request: pytest.FixtureRequest) -> None:
    if os.environ.get(FUZZ_ENV):
        request.config.pluginmanager.register(_CoverageReport(), "trio-sglang-fuzz-coverage")


# -- the properties ------------------------------------------------------------


@settings_for("test_lifecycle_fuzz")
@given(scenario=scenarios())
def test_lifecycle_fuzz(scenario: Scenario) -> None:
    policy = replace(LONG_POLICY, shutdown_grace=scenario.shutdown_grace)
    outcome = run(scenario, policy)
    COVERAGE.record("test_lifecycle_fuzz", scenario, outcome)
    check_invariants(scenario, outcome, policy, generous=True)


@settings_for("test_shutdown_fuzz")
@given(scenario=scenarios(graces=(0.0, 0.001, 0.25, 2.0), always_shut_down=True))
def test_shutdown_fuzz(scenario: Scenario) -> None:
    policy = ts.AbortPolicy(shutdown_grace=scenario.shutdown_grace)
    outcome = run(scenario, policy)
    COVERAGE.record("test_shutdown_fuzz", scenario, outcome)
    check_invariants(scenario, outcome, policy, generous=False)


# -- regressions found by the fuzzer ---------------------------------------------
#
# Each one is a falsifying example, minimised and written out, so that it runs
# on every test run whatever hypothesis draws. They fail until the bug named
# in the docstring is fixed in src/.


async def stop_at(ctx: ts.RequestContext, when: float) -> None:
    await trio.sleep_until(when)
    ctx.stop()


@pytest.mark.parametrize(
    ("stopped_at", "aborted_at"), [(0.5, 1.5), (3.0, 3.0)], ids=["tokenizing", "mid_stream"]
)
async def test_regression_native_batch_of_one_prompt_is_aborted_without_release_on_close(
    stopped_at: float, aborted_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    """Found by ``test_lifecycle_fuzz``: a stopped batch of ONE prompt decoded to its end.

    ``ParsedRequest.engine_request`` (src/trio_sglang/_request/_parse.py) sends the
    minted rid as a plain string when it minted only one, even for a native
    batch (``text=[prompt]``); SGLang (``GenerateReqInput._normalize_rid``)
    and the SimEngine then register ``<rid>_0``, an id the worker does not
    know. Its cleanup only ever asks about ``<rid>``, sees it absent and stops:
    on an engine whose close releases nothing, the request is never aborted.

    Timeline: registered at 0, dispatched at 1.5, tokens at 2.5 ... 6.5.
    Expected: the abort follows the stop (or the dispatch, if later), and no
    token is decoded after the stop. Seen: no abort, every token decoded.
    """
    engine = slow_sim(release_on_close=False)
    ctx = ts.RequestContext("ctx-batch-of-one")
    request = {"text": ["the only prompt"], "sampling_params": {"max_new_tokens": 5}}
    async with ts.open_worker(engine) as worker, trio.open_nursery() as nursery:
        nursery.start_soon(stop_at, ctx, stopped_at)
        async with worker.generate(request, ctx, output="tokens") as chunks:
            async for _ in chunks:
                pass
        assert trio.current_time() == stopped_at
        await trio.sleep(10)  # the cleanup's time, before the worker is left
    trace = engine.trace
    assert [e.time for e in trace if e.kind == "abort_requested"] == [aborted_at]
    assert [e for e in trace if e.kind == "token" and e.time > stopped_at] == []
    assert engine.live_rids() == set()


async def test_regression_streams_ended_by_a_shutdown_with_no_grace_get_engine_shutdown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Found by ``test_shutdown_fuzz``: a consumer got RuntimeError, not EngineShutdown.

    With ``shutdown_grace=0`` the worker's ``_shutdown`` returns before the
    streams it ended have left their blocks, and the worker's nursery closes
    (no child left) with a schedule point before ``open_worker`` sets
    ``Worker._nursery_closed`` (src/trio_sglang/_core/_worker.py, in the ``finally``
    after the nursery). A consumer whose cancelled pull runs in that window
    hands its cleanup over (``Worker._hand_over``), which calls ``start_soon``
    on the closed nursery: ``RuntimeError("Nursery is closed to new
    arrivals")`` comes out of the caller's block instead of ``EngineShutdown``.
    Whether the consumer runs in that window is up to trio's scheduling
    order (it must run after the worker's task, which is a coin flip), so the
    test shuts down with a stream in a pull 30 times over.
    """
    request = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    got: list[Exception] = []

    async def consume(worker: ts.Worker) -> None:
        try:
            async with worker.generate(request, ts.RequestContext("ctx-shutdown")) as chunks:
                async for _ in chunks:
                    pass
        except Exception as exc:
            got.append(exc)

    for _ in range(30):
        async with trio.open_nursery() as outside:
            policy = ts.AbortPolicy(shutdown_grace=0.0)
            async with ts.open_worker(ts.SimEngine(), policy=policy) as worker:
                outside.start_soon(consume, worker)
                await trio.sleep(0.01)  # the consumer waits for its first token
    assert len(got) == 30
    assert [exc for exc in got if not isinstance(exc, ts.EngineShutdown)] == []

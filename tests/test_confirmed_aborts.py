"""Aborts the scheduler misses are heard and sent again (``Cleanup._confirm``).

On the SimEngine with ``missed_aborts``: its scheduler lets a request's first
aborts pass it by and decodes on (SGLang issue #36876), and its
TokenizerManager, like SGLang's from 0.5.20, sends only the first abort of a
request, so nothing but an abort sent again, straight to the scheduler, stops
it. Timeline on ``slow_sim()``: dispatched at 1.5, tokens at 2.5, 3.5, ...
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import trio
import trio.testing

import trio_sglang as ts
from conftest import SLOW_KNOBS, Recorder, read, slow_sim, unchecked
from trio_sglang._core._cleanup import Cleanup
from trio_sglang._core._cleanup_group import open_cleanup_group
from trio_sglang._core._drain import Drain
from trio_sglang._core._outputs import PublicIds
from trio_sglang._core._reports import Reports
from trio_sglang._core._shared import DEAF, Shared
from trio_sglang._engine import HearsScheduler, RequestPhase, SchedulerEcho
from trio_sglang.sim._tokenizer import SimStream

#: Long enough that a request decoding for nobody is plain to see.
REQUEST: dict[str, Any] = {"text": "hello there", "sampling_params": {"max_new_tokens": 40}}


class Deaf:
    """The SimEngine without its ears: only the ``Engine`` protocol (the lifecycle before)."""

    def __init__(self, sim: ts.SimEngine) -> None:
        self.sim = sim

    def __getattr__(self, name: str) -> Any:
        if name in ("echo", "forget_echo", "abort_again"):
            raise AttributeError(name)
        return getattr(self.sim, name)


def tokens_after(engine: ts.SimEngine, time: float) -> int:
    return sum(1 for event in engine.trace if event.kind == "token" and event.time > time)


async def leave_at(worker: ts.Worker, chunks: int, name: str = "c") -> float:
    await read(worker, REQUEST, ts.RequestContext(name), leave_after=chunks)
    return trio.current_time()


class Forgetful(ts.SimEngine):
    """SGLang 0.5.18 and 0.5.19 as ``SGLangEngine`` drives them: a closed stream's dispatched
    request is aborted (by the adapter, before SGLang's close), then forgotten: the engine
    no longer holds it, and only the scheduler's outputs tell that it decodes on."""

    def generate(self, request: Mapping[str, Any]) -> Forgetting:
        return Forgetting(super().generate(request), self.tokenizer_manager)


class Forgetting:
    def __init__(self, stream: SimStream, tm: Any) -> None:
        self._stream = stream
        self._tm = tm

    def __aiter__(self) -> Forgetting:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self._stream.__anext__()
        except BaseException:
            self._forget()  # a cancelled pull ran the release path
            raise

    async def aclose(self) -> None:
        await self._stream.aclose()
        self._forget()

    def _forget(self) -> None:
        for state in self._stream._states:
            self._tm.rid_to_state.pop(state.rid, None)


async def leave_in_a_pull(worker: ts.Worker, name: str = "c") -> float:
    """Read until 3.0, between the first two tokens: the pull in progress is cancelled."""
    with trio.move_on_at(3.0):
        await read(worker, REQUEST, ts.RequestContext(name))
    return trio.current_time()


LEAVING = {"between pulls": lambda worker: leave_at(worker, 2), "in a pull": leave_in_a_pull}


@pytest.mark.parametrize("leaving", LEAVING)
@pytest.mark.parametrize("make", [slow_sim, lambda **knobs: Forgetful(**{**SLOW_KNOBS, **knobs})])
async def test_a_missed_abort_is_sent_again_and_the_request_stops(
    make: Callable[..., ts.SimEngine],
    leaving: str,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make(missed_aborts=1)
    recorder = Recorder()
    # Its quiet bound past the token interval (1 s): a forgotten id's outputs are all there is.
    policy = ts.AbortPolicy(release_timeout=1.5)
    async with ts.open_worker(engine, policy=policy, observer=recorder) as worker:
        left = await LEAVING[leaving](worker)
        await trio.sleep(60)
        kinds = [event.kind for event in engine.trace]
        assert kinds.count("abort_requested") == 1  # the release path's, then the flag
        assert kinds.count("abort_missed") == 1
        assert kinds.count("abort_resent") == 1
        assert kinds.count("abort_applied") == 1
        # What was in flight (``outputs_after_abort``), and the one that told it was missed.
        assert tokens_after(engine, left) == ts.AbortPolicy().outputs_after_abort + 1
        assert engine.live_rids() == set()
        assert not engine.tokenizer_manager.echoes  # read, and forgotten
    assert recorder.faults == ["abort_missed"]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("engine fault abort_missed: request c (rids ")
    assert "it stopped after 2 aborts (3 outputs since the first)" in record.getMessage()


async def test_an_ordered_abort_the_scheduler_missed_is_sent_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An engine whose close does not release: the abort follows the dispatch, then is heard."""
    engine = slow_sim(release_on_close=False, missed_aborts=1)
    recorder = Recorder()
    async with ts.open_worker(engine, observer=recorder) as worker:
        left = await leave_at(worker, 2)
        await trio.sleep(60)
    kinds = [event.kind for event in engine.trace]
    assert (kinds.count("abort_requested"), kinds.count("abort_resent")) == (1, 1)
    assert "abort_dropped" not in kinds  # no retry through the flag
    assert tokens_after(engine, left) == ts.AbortPolicy().outputs_after_abort + 1
    assert engine.live_rids() == set()
    assert recorder.faults == ["abort_missed"]


async def test_without_its_ears_the_lifecycle_leaves_the_request_decoding(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same fault, the engine seen through the bare protocol: the check above can fail."""
    engine = slow_sim(missed_aborts=1)
    deaf = Deaf(engine)
    assert not isinstance(deaf, HearsScheduler)
    recorder = Recorder()
    async with ts.open_worker(deaf, observer=recorder) as worker:  # type: ignore[arg-type]
        left = await leave_at(worker, 2)
        await trio.sleep(60)
    kinds = [event.kind for event in engine.trace]
    assert kinds.count("finished") == 1  # decoded to its end
    assert "abort_dropped" not in kinds  # the close's abort was on its way: none after it
    assert tokens_after(engine, left) == 40 - 2
    assert recorder.faults == ["cleanup_timeout"]


async def test_a_scheduler_that_misses_every_abort_is_reported_after_the_last(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    policy = ts.AbortPolicy(abort_attempts=3)
    engine = slow_sim(missed_aborts=10)
    recorder = Recorder()
    async with ts.open_worker(engine, policy=policy, observer=recorder) as worker:
        await leave_at(worker, 2)
        await trio.sleep(60)
    kinds = [event.kind for event in engine.trace]
    assert kinds.count("abort_requested") + kinds.count("abort_resent") == 3
    assert kinds.count("abort_missed") == 3
    assert recorder.faults == ["abort_outlived"]
    assert "engine fault abort_outlived" in caplog.text
    assert "after 3 aborts" in caplog.text


@pytest.mark.parametrize("leaving", LEAVING)
async def test_an_abort_the_scheduler_takes_is_not_sent_again(
    leaving: str, autojump_clock: trio.testing.MockClock
) -> None:
    engine = slow_sim()
    recorder = Recorder()
    async with ts.open_worker(engine, observer=recorder) as worker:
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(LEAVING[leaving], worker)
        await trio.testing.wait_all_tasks_blocked()
        assert not engine.tokenizer_manager.echoes  # each one read and forgotten
        await trio.sleep(60)
    kinds = [event.kind for event in engine.trace]
    assert kinds.count("abort_applied") == 20
    assert "abort_resent" not in kinds
    assert recorder.faults == []


@pytest.mark.parametrize("outputs", [0, 1, 4])
async def test_outputs_after_abort_is_what_the_scheduler_may_send_before_it_counts_as_missed(
    outputs: int, autojump_clock: trio.testing.MockClock
) -> None:
    policy = ts.AbortPolicy(outputs_after_abort=outputs)
    engine = slow_sim(missed_aborts=1)
    async with ts.open_worker(engine, policy=policy) as worker:
        left = await leave_at(worker, 2)
        await trio.sleep(60)
    assert tokens_after(engine, left) == outputs + 1


async def test_an_abort_sent_again_that_raises_is_reported(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = slow_sim(missed_aborts=1)

    async def broken(rid: str) -> None:
        raise RuntimeError("socket closed")

    monkeypatch.setattr(engine, "abort_again", broken)
    recorder = Recorder()
    async with ts.open_worker(engine, observer=recorder) as worker:
        await leave_at(worker, 2)
        await trio.sleep(60)
    assert recorder.faults == ["abort_error"]


# -- the confirmation itself, against a scheduler the test plays ------------------------------


class Ears:
    """A ``HearsScheduler`` with one echo; records when an abort went again."""

    def __init__(self, echo: SchedulerEcho) -> None:
        self._echo = echo
        self.again: list[float] = []

    def echo(self, rid: str) -> SchedulerEcho | None:
        return self._echo

    def forget_echo(self, rid: str) -> None:
        return None

    async def abort_again(self, rid: str) -> None:
        self.again.append(trio.current_time())
        await trio.lowlevel.checkpoint()


async def outputs(echo: SchedulerEcho, every: float, finish_at: float = math.inf) -> None:
    """The scheduler decoding the id on: an output every ``every`` s, its last at ``finish_at``."""
    while trio.current_time() + every < finish_at:
        await trio.sleep(every)
        echo.heard(finished=False)
    await trio.sleep_until(finish_at)
    echo.heard(finished=True)


class Registry:
    """The engine as the confirmation reads it: whether it still holds the id."""

    def __init__(self, held: bool) -> None:
        self.held = held

    def phase(self, rid: str) -> RequestPhase:
        return RequestPhase.DISPATCHED if self.held else RequestPhase.ABSENT


class Request:
    """The request a ``Cleanup`` stops, as it sees it; the confirmation reads its public id."""

    ids = PublicIds("pub")
    stream: Any = None

    def unfinished(self) -> list[str]:
        return ["rid-1"]

    def stopped(self) -> None:
        return None


async def confirm_abort(
    ears: Ears,
    echo: SchedulerEcho,
    *,
    held: bool,
    recorder: Recorder,
    policy: ts.AbortPolicy | None = None,
) -> None:
    """The cleanup of one request's ``rid-1`` listens to ``ears`` after its abort."""
    async with open_cleanup_group() as group:
        policy = policy or ts.AbortPolicy()
        reports = Reports(recorder)
        shared = Shared(
            engine=Registry(held),  # type: ignore[arg-type]
            policy=policy,
            group=group,
            reports=reports,
            release_on_close=True,
            release_aborts_once=True,
            stall_timeout=None,
            hears=ears,
            check=unchecked,
            blocks=Drain(),
            prefill=None,
            prefill_cancel_anytime=False,
        )
        await Cleanup(shared, Request(), frozenset())._confirm("rid-1", echo)


async def confirm(
    echo: SchedulerEcho, *, held: bool, recorder: Recorder, policy: ts.AbortPolicy | None = None
) -> tuple[float, list[float]]:
    """The confirmation from 0; when it returned, and when it sent an abort again."""
    ears = Ears(echo)
    await confirm_abort(ears, echo, held=held, recorder=recorder, policy=policy)
    return trio.current_time(), ears.again


async def test_a_quiet_scheduler_on_an_id_the_engine_let_go_has_taken_the_abort(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    assert await confirm(SchedulerEcho(), held=False, recorder=recorder) == (1.0, [])
    assert recorder.faults == []


async def test_a_quiet_scheduler_on_an_id_the_engine_holds_is_listened_to_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Busy with a long forward, say: no abort is sent again, and its finish is waited for."""
    echo, recorder = SchedulerEcho(), Recorder()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outputs, echo, 10.0, 5.0)
        assert await confirm(echo, held=True, recorder=recorder) == (5.0, [])
    assert recorder.faults == []


async def test_the_outputs_in_flight_do_not_count_as_missed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    echo, recorder = SchedulerEcho(), Recorder()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outputs, echo, 1.0, 2.5)  # two outputs, then the abort finish
        assert await confirm(echo, held=True, recorder=recorder) == (2.5, [])
    assert recorder.faults == []


async def test_each_abort_sent_again_waits_for_the_outputs_after_the_last(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A scheduler that never takes one: sent again after 3 outputs, twice, then reported."""
    echo, recorder = SchedulerEcho(), Recorder()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outputs, echo, 1.0)
        assert await confirm(echo, held=True, recorder=recorder) == (9.0, [3.0, 6.0])
        nursery.cancel_scope.cancel()
    assert recorder.faults == ["abort_outlived"]
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "engine fault abort_outlived: request pub (rids rid-1): the scheduler decodes it on "
        "after 3 aborts (9 outputs since the first)"
    )


async def test_an_abort_sent_again_that_raises_is_reported_with_its_error(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    echo, recorder = SchedulerEcho(), Recorder()

    class Broken(Ears):
        async def abort_again(self, rid: str) -> None:
            raise ConnectionError("the scheduler's socket is closed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(outputs, echo, 1.0)
        await confirm_abort(Broken(echo), echo, held=True, recorder=recorder)
        nursery.cancel_scope.cancel()
    assert trio.current_time() == 3.0
    assert recorder.faults == ["abort_error"]
    (record,) = caplog.records
    assert record.getMessage().startswith("engine fault abort_error: request pub (rids rid-1)")
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ConnectionError)


async def test_an_abort_sent_again_that_hangs_is_reported_after_abort_timeout(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    echo, recorder = SchedulerEcho(), Recorder()

    class Stuck(Ears):
        async def abort_again(self, rid: str) -> None:
            await trio.sleep_forever()  # the scheduler's socket is full

    async with trio.open_nursery() as nursery:
        nursery.start_soon(outputs, echo, 1.0)
        await confirm_abort(Stuck(echo), echo, held=True, recorder=recorder)
        nursery.cancel_scope.cancel()
    assert trio.current_time() == 3.0 + ts.AbortPolicy().abort_timeout
    assert recorder.faults == ["abort_timeout"]
    (record,) = caplog.records
    assert record.getMessage() == (
        "engine fault abort_timeout: request pub (rids rid-1): sending it again took over 1.0s"
    )


def test_an_engine_that_does_not_hear_has_no_echo_and_sends_nothing_again() -> None:
    assert DEAF.echo("rid-1") is None
    DEAF.forget_echo("rid-1")
    with pytest.raises(RuntimeError, match="nothing is sent again"):
        trio.run(DEAF.abort_again, "rid-1")

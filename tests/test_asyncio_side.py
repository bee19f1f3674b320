"""trio as the guest of an asyncio loop, and each side awaiting the other.

The code under test is ``_asyncio_bridge/_asyncio_side.py``.

Every test runs a real guest run (``run_as_guest``) on asyncio's own loop or
uvloop, whichever is installed. A call across is owned by its caller: a
cancel on either side cancels the other and, on the trio side, waits for
the asyncio code's own cleanup, within ``CANCEL_GRACE`` (on trio's
``MockClock``: the grace passes at once when nothing else can run).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from trio_sglang import SGLangEngine, run_as_guest
from trio_sglang._asyncio_bridge._asyncio_side import CANCEL_GRACE, TrioCalls, guest_side
from trio_sglang._asyncio_bridge._guest import run_beside_asyncio


def on_guest_side(body: Callable[[Any], Awaitable[Any]], **kwargs: Any) -> Any:
    """``body(side)`` in a guest run; its result."""

    async def main(loop: asyncio.AbstractEventLoop) -> Any:
        return await body(guest_side(loop))

    return run_as_guest(main, **kwargs)


def test_the_program_gets_the_running_host_loop_and_its_result_comes_back() -> None:
    async def main(loop: asyncio.AbstractEventLoop, x: int) -> tuple[bool, int]:
        await trio.lowlevel.checkpoint()
        return loop.is_running(), x * 2

    assert run_as_guest(main, 21) == (True, 42)


def test_what_the_program_raises_is_raised() -> None:
    async def main(loop: asyncio.AbstractEventLoop) -> None:
        raise LookupError("from trio")

    with pytest.raises(LookupError, match="from trio"):
        run_as_guest(main)


def test_an_unknown_loop_kind_is_refused() -> None:
    async def main(loop: object) -> None:
        raise AssertionError("ran")

    with pytest.raises(ValueError, match="unknown asyncio loop kind 'uvloop'"):
        run_beside_asyncio("uvloop", main)  # type: ignore[arg-type]


def test_a_loop_that_is_not_running_is_no_host() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="not running"):
            guest_side(loop)
    finally:
        loop.close()


def test_a_call_returns_what_the_coroutine_returns_and_raises_what_it_raises() -> None:
    async def double(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    async def fail() -> None:
        await asyncio.sleep(0)
        raise KeyError("asyncio")

    async def body(side: Any) -> int:
        with pytest.raises(KeyError, match="asyncio"):
            await side.call(fail)
        result: int = await side.call(double, 21)
        return result

    assert on_guest_side(body) == 42


def test_a_cancelled_call_returns_only_after_the_asyncio_cleanup() -> None:
    steps: list[str] = []

    async def holds() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            steps.append("cleanup started")
            await asyncio.sleep(0)  # a cleanup that itself awaits
            await asyncio.sleep(0)
            steps.append("cleanup ended")

    async def body(side: Any) -> None:
        with trio.move_on_after(0.01):
            await side.call(holds)
        steps.append("the trio call returned")

    on_guest_side(body)
    assert steps == ["cleanup started", "cleanup ended", "the trio call returned"]


def test_a_call_cancelled_before_its_task_ran_never_starts_the_function() -> None:
    started: list[bool] = []

    async def work() -> None:
        started.append(True)

    async def body(side: Any) -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            await side.call(work)
        await trio.sleep(0.01)  # the host loop has turned since

    on_guest_side(body)
    assert started == []


def test_a_call_that_ignores_its_cancel_is_let_go_after_the_grace() -> None:
    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # the call's cancel, ignored
            await asyncio.sleep(3600)
        await asyncio.sleep(3600)

    async def body(side: Any) -> float:
        start = trio.current_time()
        with trio.move_on_after(1):
            await side.call(stubborn)
        return trio.current_time() - start

    clock = trio.testing.MockClock(autojump_threshold=0)
    # asyncio.run cancels the task left over when the run ends, and it ends then.
    assert on_guest_side(body, clock=clock) == pytest.approx(1 + CANCEL_GRACE)


def test_asyncio_awaits_a_trio_call_and_meets_what_it_raises() -> None:
    async def in_trio(x: int) -> int:
        await trio.lowlevel.checkpoint()
        if x < 0:
            raise ValueError("negative")
        return x + 1

    async def body(side: Any) -> tuple[int, str]:
        async with trio.open_nursery() as nursery:
            calls = TrioCalls(nursery)

            async def asyncio_code() -> tuple[int, str]:
                try:
                    await calls(in_trio, -1)
                except ValueError as exc:
                    return await calls(in_trio, 1), str(exc)
                raise AssertionError("not raised")

            result: tuple[int, str] = await side.call(asyncio_code)
            return result

    assert on_guest_side(body) == (2, "negative")


def test_an_asyncio_caller_cancelled_cancels_its_trio_call() -> None:
    seen: list[str] = []

    async def in_trio() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append("trio call cancelled")
            raise

    async def body(side: Any) -> None:
        async with trio.open_nursery() as nursery:
            calls = TrioCalls(nursery)

            async def asyncio_code() -> None:
                task = asyncio.ensure_future(calls(in_trio))
                await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            await side.call(asyncio_code)
        # The nursery closed: the trio call has ended.

    on_guest_side(body)
    assert seen == ["trio call cancelled"]


def test_the_nursery_cancelled_cancels_the_asyncio_caller() -> None:
    async def body(side: Any) -> str:
        async with trio.open_nursery() as nursery:
            calls = TrioCalls(nursery)

            async def asyncio_code() -> str:
                try:
                    await calls(trio.sleep_forever)
                except asyncio.CancelledError:
                    return "caller cancelled"
                return "not cancelled"

            async def cancel_soon() -> None:
                await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_soon)
            with trio.CancelScope(shield=True):
                outcome: str = await side.call(asyncio_code)
            return outcome

    assert on_guest_side(body) == "caller cancelled"


def test_a_call_into_a_closed_nursery_is_cancelled_not_lost() -> None:
    async def body(side: Any) -> str:
        async with trio.open_nursery() as nursery:
            calls = TrioCalls(nursery)

        async def asyncio_code() -> str:
            try:
                await calls(trio.sleep, 0)
            except asyncio.CancelledError:
                return "cancelled"
            return "ran"

        result: str = await side.call(asyncio_code)
        return result

    assert on_guest_side(body) == "cancelled"


class _SGLangLikeTokenizerManager:
    """What ``auto_create_handle_loop`` does to SIGTERM on SGLang: takes it on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def auto_create_handle_loop(self) -> None:
        self._loop.add_signal_handler(signal.SIGTERM, lambda: None)


def test_sigterm_goes_back_to_the_programs_own_handler_when_sglang_starts() -> None:
    def own(signum: int, frame: object) -> None:
        pass

    async def main(loop: asyncio.AbstractEventLoop) -> Any:
        engine = SGLangEngine(
            tokenizer_manager=_SGLangLikeTokenizerManager(loop), asyncio_loop=loop
        )
        await guest_side(loop).call(engine._start_receiving, loop)
        return signal.getsignal(signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, own)
    try:
        # asyncio's and uvloop's remove_signal_handler leave SIG_DFL: the first
        # SIGTERM would kill a guest run's process instead of shutting it down.
        assert run_as_guest(main) is own
    finally:
        signal.signal(signal.SIGTERM, before)

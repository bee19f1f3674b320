"""``CleanupGroup``: the owner of a worker's engine-side tasks, on MockClock.

What it promises: its tasks outlive whoever cancels the block it was opened
in, ``close`` ends them at one deadline (and only then), tasks handed over
during that grace still run, the group says when nothing is pending, and a
closed group refuses work with ``EngineShutdown``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

import trio_sglang as ts
from trio_sglang._core._cleanup_group import open_cleanup_group


async def sleep_then_note(seconds: float, ended: list[float]) -> None:
    await trio.sleep(seconds)
    ended.append(trio.current_time())


async def test_tasks_run_and_the_group_says_when_nothing_is_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ended: list[float] = []
    async with open_cleanup_group() as group:
        await group.wait_idle()  # at once: nothing started
        assert trio.current_time() == 0
        group.start_soon(sleep_then_note, 2.0, ended)
        group.start_soon(sleep_then_note, 1.0, ended)
        assert group.pending == 2  # counted from the start, before the tasks run
        await group.wait_idle()
        assert trio.current_time() == 2.0
        assert group.pending == 0
        group.close(trio.current_time() + 1.0)
    assert ended == [1.0, 2.0]
    assert trio.current_time() == 2.0  # nothing was left to wait for


async def test_cancelling_the_block_does_not_reach_the_tasks_only_close_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The block's own cancel (a crash beside it, a deadline) leaves the tasks their grace."""
    ended: list[tuple[str, float]] = []

    async def work(name: str, seconds: float) -> None:
        try:
            await trio.sleep(seconds)
        finally:
            ended.append((name, trio.current_time()))

    with trio.move_on_after(1.0):
        async with open_cleanup_group() as group:
            group.start_soon(work, "short", 3.0)
            group.start_soon(work, "long", 10.0)
            try:
                await trio.sleep_forever()
            finally:
                group.close(trio.current_time() + 4.0)  # at 1.0: the grace ends at 5.0
    assert ended == [("short", 3.0), ("long", 5.0)]
    assert trio.current_time() == 5.0


async def test_work_handed_over_during_the_grace_still_runs_and_a_closed_group_refuses_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ended: list[float] = []
    async with open_cleanup_group() as group:
        group.start_soon(sleep_then_note, 1.0, ended)
        group.close(2.0)
        group.start_soon(sleep_then_note, 1.5, ended)  # during the grace: runs, same deadline
        group.start_soon(sleep_then_note, 5.0, ended)  # cut at 2.0
    assert ended == [1.0, 1.5]
    assert trio.current_time() == 2.0
    with pytest.raises(ts.EngineShutdown):
        group.start_soon(sleep_then_note, 1.0, ended)


async def test_leaving_the_block_without_close_gives_no_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_cleanup_group() as group:
        group.start_soon(trio.sleep, 10.0)
    assert trio.current_time() == 0


async def test_a_worker_waits_until_its_engine_side_work_is_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``Worker.wait_idle``: after a cancel, until the cleanup has stopped the request."""
    engine = ts.SimEngine(tokenize_delay=1.0, dispatch_delay=0.5, release_on_close=False)
    async with ts.open_worker(engine) as worker:
        request = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
        with trio.move_on_after(0.5):
            async with worker.generate(request, ts.RequestContext("idle")) as chunks:
                async for _ in chunks:
                    pytest.fail("cancelled before the first token")
        assert worker.pending_cleanups == 1
        assert engine.live_rids() != set()
        await worker.wait_idle()
        assert worker.pending_cleanups == 0
        assert engine.live_rids() == set()
        assert trio.current_time() == 1.5  # dispatched, and aborted, at 1.5


# -- waiting for the group -----------------------------------------------------------------------


@pytest.mark.mutant_pin
async def test_wait_idle_waits_again_after_the_group_was_idle_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_cleanup_group() as group:
        for _ in range(2):
            group.start_soon(trio.sleep, 1.0)
            started = trio.current_time()
            await group.wait_idle()
            assert trio.current_time() == started + 1.0

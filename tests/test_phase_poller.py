"""``PhasePoller``: one task per engine looks at the registry for every waiter (MockClock).

What it promises: a waiter wakes at the first tick after its rid's phase
changed, with the new phase; one tick looks at every waited-on rid once and
wakes only those that changed; a cancelled waiter leaves nothing behind;
with nobody waiting, it does not look at all.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_sglang import RequestPhase
from trio_sglang._sglang._phase_poller import PhasePoller

TICK = 0.01


class Registry:
    """A stand-in for ``rid_to_state``: phases set by the test, looks counted."""

    def __init__(self) -> None:
        self.phases: dict[str, RequestPhase] = {}
        self.looks = 0

    def phase(self, rid: str) -> RequestPhase:
        self.looks += 1
        return self.phases.get(rid, RequestPhase.ABSENT)


async def test_waiters_wake_at_the_first_tick_after_their_change_and_only_they(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = Registry()
    poller = PhasePoller(registry.phase, TICK)
    woken: dict[str, tuple[float, RequestPhase]] = {}

    async def wait(rid: str) -> None:
        phase = await poller.wait_change(rid, RequestPhase.REGISTERED)
        woken[rid] = (trio.current_time(), phase)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        for i in range(100):
            registry.phases[f"r{i}"] = RequestPhase.REGISTERED
            nursery.start_soon(wait, f"r{i}")
        await trio.sleep(0.105)
        assert poller.waiting == 100
        registry.phases["r7"] = RequestPhase.DISPATCHED
        del registry.phases["r9"]
        looks = registry.looks
        await trio.sleep(TICK)  # one tick
        assert registry.looks - looks <= 100 + 2  # every waiter looked at once (and the woken)
        assert poller.waiting == 98
        nursery.cancel_scope.cancel()
    # Changed at 0.105: woken by the tick at 0.11, with the phase they changed to.
    assert woken == {
        "r7": (pytest.approx(0.11), RequestPhase.DISPATCHED),
        "r9": (pytest.approx(0.11), RequestPhase.ABSENT),
    }


async def test_a_phase_that_already_differs_returns_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = Registry()
    poller = PhasePoller(registry.phase, TICK)  # not even running
    assert await poller.wait_change("gone", RequestPhase.REGISTERED) is RequestPhase.ABSENT
    assert trio.current_time() == 0


async def test_a_cancelled_waiter_leaves_nothing_and_an_idle_poller_does_not_look(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = Registry()
    registry.phases["slow"] = RequestPhase.REGISTERED
    poller = PhasePoller(registry.phase, TICK)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        with trio.move_on_after(1.0):
            await poller.wait_change("slow", RequestPhase.REGISTERED)
        assert poller.waiting == 0
        await trio.sleep(TICK)  # the tick that finds nobody waiting
        looks = registry.looks
        await trio.sleep(3600)
        assert registry.looks == looks  # an hour idle: not one look
        # And it wakes up for the next waiter.
        registry.phases["next"] = RequestPhase.REGISTERED
        nursery.start_soon(poller.wait_change, "next", RequestPhase.REGISTERED)
        await trio.sleep(TICK / 2)
        registry.phases["next"] = RequestPhase.DISPATCHED
        await trio.sleep(TICK)
        assert poller.waiting == 0
        nursery.cancel_scope.cancel()

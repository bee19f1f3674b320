"""``Handoff``'s trio side: a memory channel of capacity one (its asyncio side:
``test_handoff_asyncio.py``, where trio-asyncio is installed)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from trio_sglang._asyncio_bridge._handoff import Handoff


async def test_the_trio_side_holds_one_item_and_waits_for_room() -> None:
    handoff: Handoff[int] = Handoff()
    sent: list[int] = []

    async def produce() -> None:
        for n in range(3):
            await handoff.send(n)
            sent.append(n)
        handoff.close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [0]  # the second waits until the first is taken
        received = [await handoff.receive()]
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [0, 1]
        received += [await handoff.receive(), await handoff.receive()]
    with pytest.raises(trio.EndOfChannel):
        await handoff.receive()
    assert received == [0, 1, 2]


async def test_the_last_item_is_taken_before_the_end_and_nothing_goes_in_after() -> None:
    handoff: Handoff[str] = Handoff()
    handoff.send_nowait("last")
    with pytest.raises(trio.WouldBlock):
        handoff.send_nowait("one more")
    handoff.close()
    assert handoff.receive_nowait() == "last"
    with pytest.raises(trio.EndOfChannel):
        handoff.receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await handoff.send("after the end")


async def test_a_send_cancelled_while_waiting_hands_nothing_over(autojump_clock: MockClock) -> None:
    handoff: Handoff[int] = Handoff()
    handoff.send_nowait(1)
    with trio.move_on_after(1):
        await handoff.send(2)
    assert handoff.receive_nowait() == 1
    with pytest.raises(trio.WouldBlock):
        handoff.receive_nowait()


async def test_each_trio_call_is_a_checkpoint_even_when_it_does_not_wait() -> None:
    handoff: Handoff[int] = Handoff()
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await handoff.send(1)
    with pytest.raises(trio.WouldBlock):
        handoff.receive_nowait()  # a cancelled send hands nothing over
    with trio.testing.assert_checkpoints():
        await handoff.send(1)
    with trio.testing.assert_checkpoints():
        assert await handoff.receive() == 1

"""A trio program as the guest of an asyncio loop, so that SGLang's code runs at full speed.

``run_as_guest`` starts an asyncio loop (uvloop where it is installed, as
SGLang's own server runs on) and runs the trio program inside it as trio's
guest (``trio.lowlevel.start_guest_run``): asyncio callbacks and trio turns
take turns in one thread, and trio's I/O waits happen in a helper thread.
The program gets the host loop, which it hands to ``SGLangEngine``
(``asyncio_loop=``). It is found here, on the asyncio side: in trio code,
``asyncio.get_running_loop()`` cannot be trusted to name it (trio-asyncio,
once imported, answers for its own loops there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from ._asyncio_side import LoopKind, trio_asyncio

__all__ = ["run_as_guest", "run_beside_asyncio"]

T = TypeVar("T")


def run_as_guest(
    main: Callable[..., Awaitable[T]], *args: Any, clock: trio.abc.Clock | None = None
) -> T:
    """``main(loop, *args)`` in trio, as the guest of a new asyncio loop ``loop``; its result.

    The loop is uvloop's where uvloop is installed, asyncio's own otherwise.
    The run ends when ``main`` returns; what it raises is raised here.
    """

    async def host() -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            main,
            loop,
            *args,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
            # The host loop keeps the wake-up fd; trio's signal handlers still run at
            # once, as Python runs them when the loop's wait is interrupted.
            host_uses_signal_set_wakeup_fd=True,
            clock=clock,
        )
        outcome = await done
        result: T = outcome.unwrap()
        return result

    try:
        import uvloop
    except ImportError:
        return asyncio.run(host())
    result: T = uvloop.run(host())
    return result


def run_beside_asyncio(kind: LoopKind, main: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``main(loop, *args)`` in trio beside asyncio code of ``kind``; its result.

    ``guest``: ``loop`` is the host loop (``run_as_guest``). ``trio-asyncio``:
    ``loop`` is ``None``, and whoever runs asyncio code opens trio-asyncio's
    loop inside the run (``SGLangEngine`` does).
    """
    if kind == "guest":
        return run_as_guest(main, *args)
    if kind == "trio-asyncio":
        trio_asyncio()  # refused now, not at the first asyncio call
        return trio.run(main, None, *args)
    raise ValueError(f"unknown asyncio loop kind {kind!r}: guest or trio-asyncio")

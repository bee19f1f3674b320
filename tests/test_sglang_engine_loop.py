"""``SGLangEngine``'s trio-asyncio loop does what SGLang counts on asyncio's loop to do.

It takes SGLang's own pools, and it logs what a task nobody awaits raised and goes on.

SGLang's dynamic batch tokenizer (``--enable-dynamic-batch-tokenizer``) and its
multimodal processors run their work with ``loop.run_in_executor(their_pool,
...)``; trio-asyncio's loop takes only its own ``TrioExecutor`` and fails an
assertion on theirs, which failed every text request with the dynamic batch
tokenizer on (``tests/test_real_engine_configs.py`` found it). And trio-asyncio's
loop ends itself on an error nobody awaited, where asyncio's logs it: SGLang's
``/health`` check sends its request from such a task, and a decode server whose
request was refused died at its first ``/health`` (``tests/test_real_engine_pd.py``
found it). Marker ``sglang``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("trio_asyncio", reason="needs the asyncio extra")

import trio
import trio.testing
import trio_asyncio

from trio_sglang._sglang._sglang_engine import _log_errors_nobody_awaits, _take_any_executor

pytestmark = pytest.mark.sglang


async def in_pool(pool: ThreadPoolExecutor) -> int:
    """asyncio: the thread that ran a function on ``pool``, as SGLang's tokenizer runs it."""
    return await asyncio.get_running_loop().run_in_executor(pool, threading.get_ident)


async def test_a_pool_of_sglangs_own_runs_its_function_and_is_waited_on() -> None:
    async with trio_asyncio.open_loop() as loop:
        _take_any_executor(loop)
        with ThreadPoolExecutor(1) as pool:
            ran_on = await trio_asyncio.aio_as_trio(in_pool, loop=loop)(pool)
            assert ran_on == pool.submit(threading.get_ident).result()
        assert ran_on != threading.get_ident()


async def test_trio_asyncio_alone_refuses_it() -> None:
    """What the engine's loop did before: the check above can fail."""
    async with trio_asyncio.open_loop() as loop:
        with ThreadPoolExecutor(1) as pool, pytest.raises(AssertionError):
            await trio_asyncio.aio_as_trio(in_pool, loop=loop)(pool)


async def test_trio_asyncios_own_executor_is_still_its_own() -> None:
    async with trio_asyncio.open_loop() as loop:
        _take_any_executor(loop)
        ran_on = await trio_asyncio.aio_as_trio(
            lambda: asyncio.get_running_loop().run_in_executor(None, threading.get_ident),
            loop=loop,
        )()
    assert ran_on != threading.get_ident()


async def nobody_awaits() -> None:
    """asyncio: a task that raises, and that nobody awaits (SGLang's ``/health`` makes one)."""

    async def refused() -> None:
        raise ValueError("refused")

    task = asyncio.get_running_loop().create_task(refused())
    await asyncio.sleep(0)
    assert task.done()


async def test_an_error_nobody_awaits_is_logged_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        async with trio_asyncio.open_loop() as loop:
            _log_errors_nobody_awaits(loop)
            await trio_asyncio.aio_as_trio(nobody_awaits, loop=loop)()
            gc.collect()  # the task's finaliser reports what it raised
            await trio.testing.wait_all_tasks_blocked()
            assert await trio_asyncio.aio_as_trio(asyncio.sleep, loop=loop)(0, "on") == "on"
    assert "Task exception was never retrieved" in caplog.text
    assert "ValueError: refused" in caplog.text


async def test_trio_asyncio_alone_ends_the_loop_on_it() -> None:
    """What the engine's loop did before: the check above can fail."""
    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="refused"), flatten_subgroups=True):
        async with trio_asyncio.open_loop() as loop:
            await trio_asyncio.aio_as_trio(nobody_awaits, loop=loop)()
            gc.collect()
            await trio.sleep_forever()

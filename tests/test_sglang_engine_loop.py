"""``SGLangEngine``'s trio-asyncio loop takes SGLang's own pools, as asyncio's loop does.

SGLang's dynamic batch tokenizer (``--enable-dynamic-batch-tokenizer``) and its
multimodal processors run their work with ``loop.run_in_executor(their_pool,
...)``; trio-asyncio's loop takes only its own ``TrioExecutor`` and fails an
assertion on theirs, which failed every text request with the dynamic batch
tokenizer on (``tests/test_real_engine_configs.py`` found it). Marker ``sglang``.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("trio_asyncio", reason="needs the asyncio extra")

import trio_asyncio

from trio_sglang._sglang_engine import _take_any_executor

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

"""The engine a server runs, built in one place: the SimEngine or the real SGLang.

``trio-sglang serve`` opens its engine here and hands it to
``trio_sglang.server.serve``, which knows engines by the ``Engine`` protocol
and KV rooms by ``HostedKVRooms`` only, so the server never imports the
simulator. What a disaggregated SimEngine needs around it (the rooms a
prefill side hosts, the HTTP client a decode side reaches them with) is
opened and closed with the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from .._engine import Engine
from .._kv_rooms import HostedKVRooms, KVRooms
from .._sglang._sglang_engine import SGLangEngine
from ..sim import DisaggregationMode, SimEngine, SimKVRooms

__all__ = ["EngineKind", "EngineOptions", "open_engine"]

EngineKind = Literal["sim", "sglang"]


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """What ``open_engine`` builds: ``trio-sglang serve``'s engine options."""

    kind: EngineKind = "sim"
    #: SGLang's ``--disaggregation-mode``: one side of a prefill/decode pair.
    disaggregation_mode: DisaggregationMode | None = None
    #: SGLang's server arguments (``kind="sglang"``), ``model_path`` among them, as
    #: ``sglang.Engine`` takes them; ``disaggregation_mode`` among them for a PD role.
    sglang_args: Mapping[str, Any] = field(default_factory=dict)
    #: ``SimEngine`` arguments (its delays, ``disagg_timing``); its defaults where absent.
    sim_args: Mapping[str, Any] = field(default_factory=dict)
    #: The key a decode SimEngine sends to the prefill servers whose KV rooms it
    #: reaches: their ``--api-key`` (a pair shares one, as ``--prefill-url`` does).
    peer_api_key: str | None = None


@asynccontextmanager
async def open_engine(
    options: EngineOptions, *, asyncio_loop: asyncio.AbstractEventLoop | None = None
) -> AsyncIterator[tuple[Engine, HostedKVRooms | None]]:
    """The engine, and the KV rooms its server must host (a prefill SimEngine's), for the block.

    The engine is not running yet: ``serve`` (``open_worker``) runs it.
    ``asyncio_loop``: the host loop this trio run is the guest of, where an
    SGLang engine runs SGLang's code (``None``: trio-asyncio's, inside the run).
    """
    mode = options.disaggregation_mode
    if options.kind == "sglang":
        if not options.sglang_args.get("model_path"):
            raise ValueError("an SGLang engine needs a model_path")
        # SGLang runs its own bootstrap server (--disaggregation-bootstrap-port).
        disagg: dict[str, Any] = {} if mode is None else {"disaggregation_mode": mode}
        yield SGLangEngine(asyncio_loop=asyncio_loop, **{**options.sglang_args, **disagg}), None
        return
    async with AsyncExitStack() as stack:
        rooms: KVRooms | None = None
        hosted: SimKVRooms | None = None
        if mode == "prefill":
            rooms = hosted = SimKVRooms()
        elif mode == "decode":
            from ..server import open_http_kv_rooms  # the serve extra

            rooms = await stack.enter_async_context(
                open_http_kv_rooms(api_key=options.peer_api_key)
            )
        engine = SimEngine(
            **options.sim_args,
            keep_trace=False,  # a server runs for days: counts only (exported in /metrics)
            disaggregation_mode=mode,
            kv_rooms=rooms,
        )
        yield engine, hosted

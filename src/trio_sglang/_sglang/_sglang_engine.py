"""``SGLangEngine``: the real SGLang behind the engine protocol.

SGLang is asyncio code. The ``TokenizerManager``'s generator and its receive
loop run beside the worker's trio tasks in one thread, on one of two asyncio
loops (``_asyncio_bridge/_asyncio_side.py``): the host loop the trio run is the guest of
(``asyncio_loop=``, from ``run_as_guest``: SGLang at uvloop's speed), or
else trio-asyncio's loop, opened inside the trio run by ``running()``.
trio-asyncio is imported only then, so that neither ``import trio_sglang``
nor a guest run needs it. What this adapter does for the lifecycle, given how
SGLang's TokenizerManager holds and releases requests:

- ``running`` reads how the installed SGLang registers, dispatches and
  releases requests (``_sglang/_semantics.py``) and refuses a release older
  than ``MINIMUM_RELEASE`` in one line, before anything starts;
- ``generate`` builds the ``GenerateReqInput`` that ``Engine.async_generate``
  builds and pulls ``tokenizer_manager.generate_request`` one item at a time;
  a cancelled pull cancels the asyncio side, whose ``except BaseException``
  release path then runs before the pull returns (``AsyncioSide.call`` waits
  for it).
  Where that release path is missing or forgets dispatched requests (before
  0.5.20, but 0.5.17), the stream aborts them before SGLang's close runs and
  forgets what SGLang leaves registered (``_sglang/_release.py``), so every
  supported release releases on close;
- ``aclose`` closes the generator explicitly, because a generator parked at
  its ``yield`` is otherwise finalised only by the garbage collector;
- it hears its scheduler on the ids it sent an abort for, and sends an abort
  again past SGLang's once-only flag (``HearsScheduler``, ``_sglang/_scheduler_echoes.py``);
- ``phase`` reads ``rid_to_state`` and the dispatch mark; there is no event to
  wait on, so one ``PhasePoller`` task per engine looks, at a short fixed
  interval, at every rid somebody waits on (and ticks only while somebody does);
- outputs are made incremental whatever ``incremental_streaming_output`` says;
- ``render_chat`` (``ChatTemplating``) renders chat messages as SGLang's own
  chat route does, with that route's code (``_sglang/_chat_prompts.py``).

Where the runtime lacks the registry, the lifecycle falls back to the ids the
responses reveal (``phase`` then answers from what the streams have seen).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import trio

from .._asyncio_bridge._asyncio_side import (
    AsyncioSide,
    guest_side,
    open_trio_asyncio_side,
    trio_asyncio,
)
from .._core._outputs import finish_reason_type
from .._echoes import Echoes
from .._engine import EngineFeatures, RequestPhase, SchedulerEcho
from .._hosted_app import HostedApp
from .._request._values import check_at_least
from ._chat_prompts import SGLangChat
from ._cpu import prepare_cpu_engine, with_cpu_defaults
from ._fields_taken import fields_taken
from ._phase_poller import PhasePoller
from ._release import Orphans, abort_dispatched, dispatched, forget_leftovers, states_of
from ._scheduler_echoes import hearing_scheduler, send_abort
from ._semantics import (
    SGLangSemantics,
    detect_semantics,
    engine_keeps_a_tokenizer,
    require_supported,
    streams_increments,
)

__all__ = ["SGLangEngine"]

T = TypeVar("T")

#: Seconds SGLang's own shutdown (it stops the scheduler and detokenizer processes) may take.
_SHUTDOWN_TIMEOUT = 10.0


class SGLangEngine:
    """The real SGLang (0.5.10 or newer), as an engine for ``open_worker``.

    Give exactly one of: ``engine`` (an ``sglang.Engine`` you own),
    ``tokenizer_manager`` (a ``TokenizerManager`` built without an Engine, as
    the GPU-free harness does, with its ``template_manager`` if SGLang's server
    application is to be hosted over it), or SGLang server arguments (``model_path=...``
    and any other ``ServerArgs`` field, as ``sglang.Engine`` takes them), in
    which case ``running()`` launches an ``sglang.Engine`` in a thread (the
    trio loop goes on while the model loads) and shuts it down at the end.
    With ``device="cpu"`` that is SGLang's CPU engine, prepared here before
    SGLang is imported (``_sglang/_cpu.py``), with CPU defaults under the
    arguments given. ``poll_interval`` (seconds) is how often the engine looks
    at the registry for the requests that ``wait_phase_change`` callers wait on.
    ``asyncio_loop``: the running asyncio loop this trio run is the guest of
    (``run_as_guest``), where SGLang's code then runs; without it, ``running()``
    opens a trio-asyncio loop (the ``asyncio`` extra).
    """

    def __init__(
        self,
        *,
        engine: Any = None,
        tokenizer_manager: Any = None,
        template_manager: Any = None,
        poll_interval: float = 0.0005,
        asyncio_loop: asyncio.AbstractEventLoop | None = None,
        **server_args: Any,
    ) -> None:
        given = sum(x is not None for x in (engine, tokenizer_manager)) + bool(server_args)
        if given != 1:
            raise ValueError(
                "give exactly one of engine=, tokenizer_manager= or SGLang server arguments"
            )
        if template_manager is not None and tokenizer_manager is None:
            raise ValueError(
                "template_manager= goes with tokenizer_manager= (an sglang.Engine has its own)"
            )
        check_at_least("poll_interval", poll_interval, 0, above=True, finite=True)
        if asyncio_loop is None:
            trio_asyncio()  # now, rather than at the first request
        self._host_loop = asyncio_loop
        if server_args.get("device") == "cpu":
            prepare_cpu_engine()
            server_args = with_cpu_defaults(server_args)
        self._engine = engine
        self._tm = tokenizer_manager if tokenizer_manager is not None else None
        self._templates = template_manager
        self._server_args = server_args
        self._poller = PhasePoller(self.phase, float(poll_interval))
        self._running = False
        #: Where SGLang's code runs, while running: every call into SGLang goes there by
        #: name, because a task that a host started from asyncio (Dynamo's handlers)
        #: finds no current loop, or another one.
        self._side: AsyncioSide | None = None
        #: rid -> phase, from what the streams saw (only used without a registry).
        self._seen: dict[str, RequestPhase] = {}
        self._chat: SGLangChat | None = None  # made at the first chat request
        self._detected: SGLangSemantics | None = None
        #: Dispatched states whose stream died before SGLang finished them (old releases).
        self._orphans = Orphans()
        self._echoes = Echoes()

    @property
    def tokenizer_manager(self) -> Any:
        if self._tm is None:
            raise RuntimeError("the SGLang engine is not running")
        return self._tm

    @property
    def asyncio_side(self) -> AsyncioSide:
        """Where SGLang's asyncio code runs, and how trio awaits it (while running)."""
        if self._side is None:
            raise RuntimeError("the SGLang engine is not running")
        return self._side

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if self._running:
            raise RuntimeError("this SGLangEngine is already running")
        if self._detected is None:
            # In a thread: some releases (0.5.19) set uvloop's event loop policy when
            # their tokenizer_manager module is imported, which trio-asyncio refuses here.
            self._detected = await trio.to_thread.run_sync(detect_semantics)
        require_supported(self._detected)  # before a model loads for nothing
        await self._require_a_tokenizer_here()
        self._running = True
        try:
            async with (
                self._launched(),
                self._opened_side() as side,
                trio.open_nursery() as nursery,
            ):
                self._side = side
                await side.call(self._start_receiving, side.loop)
                nursery.start_soon(self._poller.run)
                try:
                    with hearing_scheduler(self._tm, self._echoes):
                        yield
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._running = False
            self._side = None

    @asynccontextmanager
    async def _opened_side(self) -> AsyncIterator[AsyncioSide]:
        """The host loop given, or trio-asyncio's loop (made fit for SGLang) for the block."""
        if self._host_loop is not None:
            yield guest_side(self._host_loop)
            return
        async with open_trio_asyncio_side() as side:
            _take_any_executor(side.loop)
            _log_errors_nobody_awaits(side.loop)
            yield side

    async def _require_a_tokenizer_here(self) -> None:
        """Refuse, in one line, an engine whose requests would go to a router that generates none.

        That is an Engine with ``tokenizer_worker_num`` above 1 on releases
        whose Engine keeps no tokenizer of its own (``engine_keeps_a_tokenizer``);
        on newer ones the worker drives the tokenizer the Engine keeps.
        """
        workers = self._server_args.get("tokenizer_worker_num", 1)
        if workers != 1 and not await trio.to_thread.run_sync(engine_keeps_a_tokenizer):
            raise ValueError(
                f"tokenizer_worker_num={workers!r}: the Engine of SGLang "
                f"{self._detected.version if self._detected else '?'} keeps no tokenizer in its "
                "own process, only a router to other processes' (newer releases keep one); "
                "leave tokenizer_worker_num at 1"
            )
        given = self._tm if self._engine is None else self._engine.tokenizer_manager
        if given is not None and not callable(getattr(given, "generate_request", None)):
            raise ValueError(
                f"the engine's tokenizer_manager is a {type(given).__name__}, which generates "
                "nothing (an Engine with tokenizer_worker_num above 1 on an older SGLang?): "
                "give one whose tokenizer_manager is a TokenizerManager"
            )

    @asynccontextmanager
    async def _launched(self) -> AsyncIterator[None]:
        """The ``sglang.Engine`` made of the server arguments, for the block (if that is this one).

        A thread of its own launches it, holds it and shuts it down: SGLang's
        scheduler and detokenizer processes die with the thread that started
        them (``PR_SET_PDEATHSIG``), so that thread must outlive the engine,
        which a pooled worker thread does not. The close waits at most
        ``_SHUTDOWN_TIMEOUT``; after that the thread finishes the shutdown alone.
        """
        if self._tm is not None or self._engine is not None:
            if self._tm is None:
                self._tm = self._engine.tokenizer_manager
            yield
            return
        stop = threading.Event()
        try:
            async with trio.open_nursery() as holder:
                self._engine = await holder.start(_hold_engine, self._server_args, stop)
                self._tm = self._engine.tokenizer_manager
                try:
                    yield
                finally:
                    stop.set()
                    holder.cancel_scope.deadline = trio.current_time() + _SHUTDOWN_TIMEOUT
        finally:
            # Shut down: the next running() launches anew.
            self._engine = self._tm = self._chat = None

    async def _start_receiving(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the TokenizerManager's receive loop on the engine's asyncio loop, now.

        SGLang starts it at the first request and, in the main thread, takes
        SIGTERM for its own graceful exit (which ends by killing the process
        tree) through the loop's signal handlers, that is through
        ``signal.signal``: the process's owner (``serve``'s ordered shutdown,
        a trio program's own handler) would never see it. Starting it here
        lets SIGTERM go back at once, to the handler it had before;
        SIGQUIT, which SGLang's children send when one of them fails, stays
        SGLang's. (asyncio's and uvloop's ``remove_signal_handler`` leave the
        default handler, which would end a guest run at the first SIGTERM.)
        """
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        self.tokenizer_manager.auto_create_handle_loop()
        loop.remove_signal_handler(signal.SIGTERM)
        if previous is not None and signal.getsignal(signal.SIGTERM) is not previous:
            signal.signal(signal.SIGTERM, previous)

    @property
    def semantics(self) -> SGLangSemantics:
        """How the installed SGLang registers, dispatches and releases requests (read once).

        Read at the start of ``running()``; before that, read here, which
        imports SGLang's TokenizerManager in the calling thread.
        """
        if self._detected is None:
            self._detected = detect_semantics()
        return self._detected

    @property
    def _covers_close(self) -> bool:
        """Whether the streams abort dispatched requests before SGLang's close (it does not)."""
        return not self.semantics.close_stops_dispatched

    def features(self) -> EngineFeatures:
        semantics = self.semantics
        # Asked before the engine runs too (``open_worker`` checks a decode worker's role).
        if self._tm is not None or self._engine is not None:
            holder = self._tm if self._tm is not None else self._engine
            mode = getattr(getattr(holder, "server_args", None), "disaggregation_mode", None)
        else:
            mode = self._server_args.get("disaggregation_mode")
        # The model's context length, which the tokenizer manager checks every request against.
        context_len = getattr(self._tm, "context_len", None)
        return EngineFeatures(
            kind="sglang",
            sglang_version=semantics.version,
            sglang_semantics=semantics.to_json(),
            request_registry=isinstance(getattr(self._tm, "rid_to_state", None), Mapping),
            dispatch_timestamp=semantics.supported,
            abort_sent_flag=semantics.abort_dedupe,
            # SGLang's own close, or this adapter's where SGLang's leaves it undone.
            release_on_close=semantics.supported,
            batch_parallel_sampling=True,
            # SGLang says "null" for an aggregated server.
            disaggregation_mode=mode if mode in ("prefill", "decode") else None,
            context_length=context_len if isinstance(context_len, int) else None,
            # An older release than trio-sglang's field tables: what it lacks is refused.
            honoured_fields=fields_taken(),
        )

    @property
    def sglang_engine(self) -> Any:
        """The ``sglang.Engine`` this adapter runs over (``None`` over a bare TokenizerManager)."""
        return self._engine

    def hosted_app(
        self, served_at: Callable[[], str | None]
    ) -> AbstractAsyncContextManager[HostedApp]:
        """SGLang's own HTTP server application over this running engine (``_server_app.py``)."""
        from ._server_app import hosted_sglang_app

        return hosted_sglang_app(self, served_at)

    @property
    def template_manager(self) -> Any:
        """The template manager an ``sglang.Engine`` loaded its ``--chat-template`` into, or
        the one given beside a bare ``tokenizer_manager`` (SGLang's OpenAI routes need one
        when its server application is hosted); else ``None``."""
        if self._templates is not None:
            return self._templates
        return getattr(self._engine, "template_manager", None)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False
    ) -> str | list[int]:
        """The prompt SGLang's chat route makes of ``messages`` (token ids for a text model)."""
        if self._chat is None:
            self._chat = SGLangChat(self.tokenizer_manager, self.template_manager)
        return self._chat.render(messages, continue_final_message=continue_final_message)

    def generate(self, request: Mapping[str, Any]) -> _SGLangStream:
        return _SGLangStream(self, request)

    def phase(self, rid: str) -> RequestPhase:
        registry = getattr(self._tm, "rid_to_state", None)
        if not isinstance(registry, MutableMapping):
            return self._seen.get(rid, RequestPhase.ABSENT)
        self._orphans.sweep(registry)
        state = registry.get(rid)
        # A finished state is let go by the scheduler (0.5.12 and older keep
        # one aborted while queued until its generator reads it).
        if state is None or state.finished:
            return RequestPhase.ABSENT
        return RequestPhase.DISPATCHED if dispatched(state) else RequestPhase.REGISTERED

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        # The registry lives on the asyncio side and announces nothing: the
        # engine's one poller looks at it for every waiter (no backoff).
        if not self._running:
            raise RuntimeError("the SGLang engine is not running")
        return await self._poller.wait_change(rid, phase)

    async def abort(self, rid: str) -> None:
        # A synchronous send on SGLang's socket to the scheduler.
        self.tokenizer_manager.abort_request(rid=rid)
        await trio.lowlevel.checkpoint()

    def echo(self, rid: str) -> SchedulerEcho | None:
        return self._echoes.get(rid)

    def forget_echo(self, rid: str) -> None:
        self._echoes.forget(rid)

    async def abort_again(self, rid: str) -> None:
        send_abort(self.tokenizer_manager, rid)  # a synchronous send, as ``abort``'s
        await trio.lowlevel.checkpoint()

    def scheduler_requests(self) -> int:
        """Running plus waiting requests, from the load snapshot SGLang's scheduler publishes.

        The scheduler publishes it as batches run and at once when it goes
        idle, so a request left decoding shows here until it ends.
        """
        reader = getattr(self._tm, "load_snapshot_reader", None)
        if reader is None:
            return 0
        return sum(load.num_running_reqs + load.num_waiting_reqs for load in reader.read_all())

    def live_requests(self) -> int:
        registry = getattr(self._tm, "rid_to_state", None)
        if isinstance(registry, MutableMapping):
            self._orphans.sweep(registry)
            return len(registry)
        return sum(p is not RequestPhase.ABSENT for p in self._seen.values())


def _take_any_executor(loop: Any) -> None:
    """Let SGLang run its work on its own pools, on trio-asyncio's loop as on asyncio's.

    trio-asyncio's ``run_in_executor`` takes only its own ``TrioExecutor``
    (or ``None``), and fails an assertion on anything else. SGLang hands it
    pools of its own: the dynamic batch tokenizer's thread
    (``--enable-dynamic-batch-tokenizer``), multimodal processors' processes.
    asyncio's loop submits the function to such a pool and waits on its
    future; so does this one now.
    """
    own = loop.run_in_executor
    trio_executor = trio_asyncio().TrioExecutor

    def run_in_executor(executor: Any, func: Callable[..., T], *args: Any) -> Any:
        if executor is None or isinstance(executor, trio_executor):
            return own(executor, func, *args)
        return asyncio.wrap_future(executor.submit(func, *args), loop=loop)

    loop.run_in_executor = run_in_executor


def _log_errors_nobody_awaits(loop: Any) -> None:
    """Log what an asyncio task nobody awaits raised, as asyncio's loop does, and go on.

    trio-asyncio's loop also raises it into its own nursery, which ends the
    loop, and the engine and ``serve`` with it. SGLang starts tasks that
    nobody awaits (its ``/health`` check sends its request from one), and
    counts on the loop only logging what they raise, as its own server's
    does; what is fatal to SGLang ends its processes by itself.
    """
    loop.set_exception_handler(asyncio.BaseEventLoop.default_exception_handler)


async def _hold_engine(
    server_args: Mapping[str, Any],
    stop: threading.Event,
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Launch an ``sglang.Engine`` in a thread, report it started, and shut it down on ``stop``.

    Never in trio's thread: importing ``sglang.srt.entrypoints.engine`` sets
    uvloop's event loop policy, which trio-asyncio refuses inside trio ("You
    can't change the event loop policy in Trio context") and allows, for that
    thread alone, in any other. The launch blocks until the model is loaded
    and the scheduler is ready (seconds to minutes); the trio loop goes on.
    Abandoned if cancelled: the thread then ends the engine by itself.
    """

    def hold() -> None:
        from sglang.srt.entrypoints.engine import Engine

        engine = Engine(**server_args)
        try:
            trio.from_thread.run_sync(task_status.started, engine)
            stop.wait()
        finally:
            engine.shutdown()  # stops SGLang's processes, and waits for them

    await trio.to_thread.run_sync(hold, abandon_on_cancel=True)


class _SGLangStream:
    """One ``generate_request`` generator, pulled from trio."""

    def __init__(self, engine: SGLangEngine, request: Mapping[str, Any]) -> None:
        self._engine = engine
        self._request = dict(request)
        # Copies of its own: which states are this request's is told by them (``_release.py``).
        params = self._request.get("sampling_params")
        if isinstance(params, Mapping):
            self._request["sampling_params"] = dict(params)
        elif isinstance(params, list):
            self._request["sampling_params"] = [dict(p) for p in params]
        self._covers = engine._covers_close
        self._obj: Any = None  # SGLang's GenerateReqInput, normalised by SGLang in place
        self._agen: Any = None
        self._closed = False
        #: Rids this stream aborted before SGLang's close (releases whose close does not).
        self._aborted: set[str] = set()
        #: Read at the first pull: whether outputs come as increments, and whether the
        #: phases are told by the streams (no registry) rather than by SGLang's registry.
        self._increments = False
        self._tells_phases = False
        self._seen_text: dict[str, int] = {}
        self._seen_ids: dict[str, int] = {}

    def __aiter__(self) -> _SGLangStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._closed:
            raise StopAsyncIteration
        engine = self._engine
        if self._agen is None:
            from sglang.srt.managers.io_struct import GenerateReqInput

            tm = engine.tokenizer_manager
            self._increments = streams_increments(tm)
            self._tells_phases = not isinstance(getattr(tm, "rid_to_state", None), MutableMapping)
            self._obj = GenerateReqInput(**self._request)
            self._agen = tm.generate_request(self._obj, None)
            self._note(self._request["rid"], RequestPhase.REGISTERED)
        pull = self._pull_aborting_first if self._covers else self._agen.__anext__
        try:
            out: dict[str, Any] = await engine.asyncio_side.call(pull)
        except StopAsyncIteration:
            self._closed = True
            self._ended()
            raise
        except BaseException:
            # A cancel that landed before the asyncio task ran left the
            # generator parked at its last yield; aclose() (the worker's
            # cleanup always calls it) then runs SGLang's release path.
            if self._agen.ag_frame is None:
                self._closed = True
                self._ended()
            raise
        return self._incremental(out)

    async def _pull_aborting_first(self) -> dict[str, Any]:
        """asyncio: the next output; if cancelled, abort what was dispatched, then let SGLang close.

        The pull runs shielded in a task of its own, which this coroutine
        always awaits to its end, so that the abort goes out while the
        request's states are still registered (``_sglang/_release.py``).
        """
        pull = asyncio.ensure_future(self._agen.__anext__())
        try:
            return await asyncio.shield(pull)
        except asyncio.CancelledError:
            if not pull.done():
                self._abort_dispatched()
                pull.cancel()
            while not pull.done():
                try:
                    await asyncio.wait([pull])
                except asyncio.CancelledError:  # cancelled again: the close must still finish
                    continue
            if not pull.cancelled():
                pull.exception()  # retrieved: the caller has gone, and gets the cancel
            raise

    def _abort_dispatched(self) -> None:
        tm = self._engine.tokenizer_manager
        states = states_of(tm.rid_to_state, self._obj, children=True)
        abort_dispatched(tm, states, self._aborted)

    def _ended(self) -> None:
        """The generator is dead: nothing can dispatch for it now; forget what SGLang left."""
        registry = getattr(self._engine.tokenizer_manager, "rid_to_state", None)
        if isinstance(registry, MutableMapping):
            states = states_of(registry, self._obj, children=self._covers)
            forget_leftovers(registry, states, self._engine._orphans)
        self._note(self._request["rid"], RequestPhase.ABSENT)

    async def aclose(self) -> None:
        if self._agen is not None and not self._closed:
            self._closed = True
            if self._covers:
                self._abort_dispatched()  # before SGLang's close can forget it
            # A no-op if the generator already finished (its release path ran).
            await self._engine.asyncio_side.call(self._agen.aclose)
            self._ended()
        self._closed = True
        await trio.lowlevel.checkpoint()

    def _note(self, rid: object, phase: RequestPhase) -> None:
        """Remember what this stream showed of its rids (the registry-less fallback)."""
        if not self._tells_phases:
            return
        for one in rid if isinstance(rid, list) else [rid]:
            if not isinstance(one, str):
                continue
            if phase is RequestPhase.ABSENT:
                self._engine._seen.pop(one, None)
            else:
                self._engine._seen[one] = phase

    def _incremental(self, out: dict[str, Any]) -> dict[str, Any]:
        """SGLang's output as an increment, whatever the server's streaming mode."""
        meta = out.get("meta_info") or {}
        rid = str(meta.get("id"))
        reason = meta.get("finish_reason")
        self._note(rid, RequestPhase.DISPATCHED if reason is None else RequestPhase.ABSENT)
        text = out.get("text")
        ids = list(out.get("output_ids") or ())
        if self._increments:
            if finish_reason_type(reason) == "abort":
                # SGLang's abort echo repeats the whole text and the last id.
                text, ids = "", []
        else:
            full_text = text if isinstance(text, str) else ""
            text = full_text[self._seen_text.get(rid, 0) :]
            self._seen_text[rid] = len(full_text)
            ids, self._seen_ids[rid] = ids[self._seen_ids.get(rid, 0) :], len(ids)
        result = {**out, "output_ids": ids}
        if text is not None:
            result["text"] = text
        return result

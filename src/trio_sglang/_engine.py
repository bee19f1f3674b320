"""The one small protocol through which the lifecycle knows an engine.

It is shaped after what SGLang 0.5.23 actually offers, so that the
real ``TokenizerManager`` and the ``SimEngine`` fit it without pretending:

- ``generate`` is ``Engine.async_generate(..., stream=True)``: a lazy stream
  that registers the request only when first pulled;
- ``phase`` is what can be observed from outside: the request registry
  (``rid_to_state``) and the dispatch timestamp;
- ``abort`` is ``tokenizer_manager.abort_request``: fire and forget, silently
  lost when sent at the wrong moment, which is why the lifecycle uses it last;
- closing the stream (or cancelling a pull) runs the engine's own release
  path: an undispatched request is forgotten, a dispatched one is aborted.

An optional capability the lifecycle uses where an engine has it:
``HearsScheduler``, an engine that tells what its scheduler sent for an id
after an abort, and can send the abort again past SGLang's once-only flag
(a scheduler can miss an abort and decode on: ``_core/_cleanup.py``).

Beside them, two optional capabilities the lifecycle never uses: ``ChatTemplating``,
an engine that renders chat messages with its model's chat template (the
server's chat route asks for it), and ``HostsApp``, an engine that brings its
own HTTP server application, which ``serve`` runs over the lifecycle
(``_hosted_app.py``).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol, runtime_checkable

import trio

from ._hosted_app import HostedApp

__all__ = [
    "ChatTemplating",
    "Engine",
    "EngineFeatures",
    "EngineStream",
    "HearsScheduler",
    "HostsApp",
    "RequestPhase",
    "Role",
    "SchedulerEcho",
]

#: A worker's role, from its engine's ``disaggregation_mode`` (``_core/_disagg.py``).
Role = Literal["aggregated", "prefill", "decode"]


class RequestPhase(enum.Enum):
    """Where a request is, as far as the engine lets anyone see."""

    #: Not held by the engine: never registered, released, finished or aborted.
    ABSENT = "absent"
    #: In the tokenizer's registry, not yet pushed to the scheduler.
    REGISTERED = "registered"
    #: Pushed to the scheduler (the dispatch timestamp is set).
    DISPATCHED = "dispatched"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFeatures:
    """What an engine detected at start, read once by the worker and the server.

    A runtime feature the lifecycle rests on defaults to absent: an engine
    claims only what it has, and the worker falls back to the safe path for
    the rest (a reader task, an abort per close).
    """

    #: What the capabilities call the engine: ``"sim"``, ``"sglang"``, ...
    kind: str = "unknown"
    #: The SGLang release whose semantics the engine has (``None``: not SGLang).
    sglang_version: str | None = None
    #: A request can be looked up by rid while the engine holds it (``rid_to_state``).
    request_registry: bool = False
    #: The engine marks the moment a request reaches its scheduler.
    dispatch_timestamp: bool = False
    #: The engine drops an abort of a request it already aborted.
    abort_sent_flag: bool = False
    #: Closing the stream releases or aborts every state it created, children included.
    release_on_close: bool = False
    #: ``n > 1`` on a native batch.
    batch_parallel_sampling: bool = False
    #: Prefill/decode disaggregation: the side this engine is, or ``None`` (aggregated).
    disaggregation_mode: Literal["prefill", "decode"] | None = None
    #: The model's context length, which the engine checks every request against.
    context_length: int | None = None
    #: The request fields the engine acts on (top-level names, and
    #: ``sampling_params.<name>``); the worker refuses a request that asks for
    #: any other (``_request/_fields.py``). ``None``: the engine honours every field.
    honoured_fields: frozenset[str] | None = None
    #: How the installed SGLang registers, dispatches and releases requests, as JSON.
    sglang_semantics: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        """A feature is claimed by ``True`` alone: a truthy stand-in is a mistake, said at once."""
        flags = [field.name for field in fields(self) if field.type == "bool"]
        wrong = [name for name in flags if not isinstance(getattr(self, name), bool)]
        if wrong:
            raise TypeError(f"EngineFeatures: {', '.join(wrong)} must be True or False")
        if not isinstance(self.sglang_version, str | None):
            raise TypeError("EngineFeatures: sglang_version must be a str or None")
        if self.disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(
                "EngineFeatures: disaggregation_mode must be None, 'prefill' or 'decode', "
                f"not {self.disaggregation_mode!r}"
            )

    @property
    def role(self) -> Role:
        return self.disaggregation_mode or "aggregated"


@runtime_checkable
class EngineStream(Protocol):
    """One request's outputs, SGLang's native dicts, incremental.

    Every output is what SGLang yields with ``stream_output`` on: ``text`` and
    ``output_ids`` carry only what is new, ``meta_info`` carries ``id`` (the
    engine rid) and ``finish_reason`` (``None`` or ``{"type": ...}``), and a
    batch or ``n > 1`` output carries its child's ``index``.

    A pull that is cancelled closes the stream, as ``aclose`` would: that is
    what SGLang's generator does when a ``CancelledError`` reaches it.
    """

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    async def __anext__(self) -> dict[str, Any]: ...

    async def aclose(self) -> None:
        """Run the engine's release path; idempotent, a no-op once finished."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an engine, and nothing more."""

    def running(self) -> AbstractAsyncContextManager[None]:
        """Own the engine's background work for the life of the block.

        The worker enters it first and leaves it last, after its cleanup.
        """
        ...

    def features(self) -> EngineFeatures:
        """What was detected at run time; the worker reads it once, at its start."""
        ...

    def generate(self, request: Mapping[str, Any]) -> EngineStream:
        """Start nothing yet: return the stream for an SGLang ``/generate`` body.

        ``request["rid"]`` is the worker's internal rid.
        """
        ...

    def phase(self, rid: str) -> RequestPhase:
        """The request's phase right now (a synchronous look, never blocks)."""
        ...

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        """Return the rid's phase as soon as it differs from ``phase``.

        Engines that can wake waiters do so; others poll at a short fixed
        interval. Unbounded: callers bound it.
        """
        ...

    async def abort(self, rid: str) -> None:
        """Ask the engine to abort ``rid`` (``abort_request``); may be lost.

        Async because an abort can wait on I/O (a socket to the scheduler, a
        remote worker); the lifecycle bounds each call with
        ``AbortPolicy.abort_timeout``. It should send before its first
        checkpoint, so that an abort issued on dispatch is not delayed.
        """
        ...

    def live_requests(self) -> int:
        """How many requests the engine holds right now (for metrics)."""
        ...


class SchedulerEcho:
    """What the scheduler has sent for one id since an abort of it went out.

    An engine that hears its scheduler keeps one per id it sent an abort for
    (``HearsScheduler``), and the lifecycle reads it: outputs that keep
    coming say the scheduler missed the abort, the id's final output (its
    abort finish, or its natural end) says it stopped.
    """

    __slots__ = ("_lot", "finished", "outputs")

    def __init__(self) -> None:
        #: Outputs that were not the id's last, since the abort.
        self.outputs = 0
        #: The id's final output has come: the scheduler let it go.
        self.finished = False
        self._lot = trio.lowlevel.ParkingLot()

    def heard(self, *, finished: bool) -> None:
        """One output for the id came from the scheduler (called by the engine)."""
        if finished:
            self.finished = True
        else:
            self.outputs += 1
        self._lot.unpark_all()

    async def changed(self) -> None:
        """Return at the next output for the id (unbounded: callers bound it)."""
        await self._lot.park()


@runtime_checkable
class HearsScheduler(Protocol):
    """An engine that hears its scheduler on an aborted id, and can abort it again.

    SGLang's scheduler can miss an abort (a request moving between batches
    decodes on), its TokenizerManager sends only the first abort of a request
    (0.5.20 on), and some releases forget a request on close while the
    scheduler still decodes it (0.5.18, 0.5.19): nothing the engine's own
    ``abort`` does can reach such a request again.
    """

    def echo(self, rid: str) -> SchedulerEcho | None:
        """What the scheduler sent for ``rid`` since the engine sent it an abort.

        The engine keeps one for every id it sent an abort for (by its release
        path or by ``abort``), until ``forget_echo``; ``None`` where it sent none.
        """
        ...

    def forget_echo(self, rid: str) -> None:
        """Stop keeping ``rid``'s echo (a no-op where there is none)."""
        ...

    async def abort_again(self, rid: str) -> None:
        """Send an abort of ``rid`` to the scheduler itself, past the once-only flag.

        A second abort of a request the scheduler holds is harmless to it.
        """
        ...


@runtime_checkable
class ChatTemplating(Protocol):
    """An engine whose model has a chat template, and that renders chat messages with it.

    Optional: OpenAI's chat route needs a prompt made of messages, and only
    the engine knows its model's template (SGLang renders it in its server,
    not in the engine the lifecycle drives). An engine without it gets the
    server's plain transcript.
    """

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool = False
    ) -> str | list[int]:
        """The prompt for ``messages``, ending where the assistant's answer starts.

        ``messages`` are OpenAI chat messages the server has checked (a known
        role, text content). The prompt is text for the engine to tokenize or
        token ids, whichever the engine's own chat route hands its tokenizer.
        ``continue_final_message``: a last assistant message is continued,
        not answered. Raises ``ValueError`` when the template refuses the
        messages: the client's error.
        """
        ...


@runtime_checkable
class HostsApp(Protocol):
    """An engine with an HTTP server application of its own (SGLang's), for ``serve`` to run.

    ``served_at()`` is the URL the server listens on, or ``None`` before it
    does (an application that warms itself up sends its request there).
    """

    def hosted_app(
        self, served_at: Callable[[], str | None]
    ) -> AbstractAsyncContextManager[HostedApp]: ...

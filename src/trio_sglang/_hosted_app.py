"""An engine's own HTTP application, hosted by ``serve``, and how its routes reach the lifecycle.

SGLang's server is more than its engine: some ninety routes, request
validation, chat templates, tool-call and reasoning parsers, usage, error
bodies. ``serve --engine sglang`` runs that very application (``_sglang/_server_app.py``)
instead of writing it again, and keeps for itself what trio-sglang is for:
the connection and its bounds, authentication, and every engine request,
which goes through the worker's lifecycle.

The seam between the two is one object per HTTP request, an ``Exchange``,
which the server puts in the request's ASGI scope under ``EXCHANGE_KEY``.
Wherever the hosted application would hand a request to its engine, it
starts it through the exchange instead and reads its outputs from the
``Feed`` it gets back. The server owns the exchange: the tasks that run
its requests, their public ids (for ``/abort_request``), their admission,
and their end when the client leaves. Beside it, under ``SEND_NOW_KEY``, a
``SendNow``: an application on another loop writes a streamed chunk with it
at once, rather than handing each to a trio task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "EXCHANGE_KEY",
    "SEND_NOW_KEY",
    "Exchange",
    "Feed",
    "FeedEnd",
    "HTTPRefusal",
    "HostedApp",
    "SendNow",
]

#: Where an ``Exchange`` is in the scope of a request the server hands to the hosted app.
EXCHANGE_KEY = "trio_sglang.exchange"
#: Where a ``SendNow`` is in that scope.
SEND_NOW_KEY = "trio_sglang.send_now"

#: A response's ``send`` without the wait, for a hosted app on another event loop in the
#: server's thread: ``True`` if the message went out, ``False`` (nothing sent) if it must
#: go through ``send``, which it then does after every message handed to ``send`` before.
#: Only a chunk of a streamed body ever goes out this way.
SendNow = Callable[[Mapping[str, Any]], bool]

#: How a feed ended: the engine finished it, ``/abort_request`` stopped it, the
#: server shut down, the engine failed (``Feed.error``), or the client left.
FeedEnd = Literal["finished", "aborted", "shutdown", "failed", "left"]


class HostedApp(Protocol):
    """An ASGI application (HTTP only), and the metrics it keeps of its own."""

    #: Whether it keeps any (SGLang's: with ``--enable-metrics``); ``metrics`` reads
    #: files, so ``/metrics`` calls it, in a thread, only then.
    keeps_metrics: bool
    #: A ``bootstrap_host`` that names no prefill server (SGLang's fake one): a decode
    #: engine given it fakes the KV cache and connects nowhere. SGLang's own health
    #: check and warm-up send it; ``None``: the engine has none.
    no_transfer_host: str | None

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None: ...

    def metrics(self) -> bytes:
        """Its own metrics in Prometheus's text format, for ``/metrics``."""
        ...


class Feed(Protocol):
    """One engine request's outputs, in the engine's own form, under public ids."""

    #: The public id of each child (output ``index``), in order; one for a single sample.
    ids: tuple[str, ...]
    #: One prompt, one sample: its outputs carry no ``index``.
    single: bool

    async def receive(self) -> dict[str, Any]:
        """The next output; ``trio.EndOfChannel`` once there are no more (then see ``end``)."""
        ...

    def receive_nowait(self) -> dict[str, Any]:
        """``receive`` without waiting, for an app on another loop: ``trio.WouldBlock``
        while the next output is not there yet."""
        ...

    def when_changed(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, when an output comes or the feed ends (``Handoff``)."""
        ...

    @property
    def end(self) -> FeedEnd | None:
        """How the request ended, once it has (``None`` before)."""
        ...

    @property
    def error(self) -> Exception | None:
        """What ended it, if the engine failed (``end == "failed"``)."""
        ...


@runtime_checkable
class Exchange(Protocol):
    """The engine requests of one HTTP request, started for the hosted application."""

    async def start(self, request: Mapping[str, Any]) -> Feed:
        """Start ``request`` (an SGLang ``/generate`` body) through the lifecycle.

        Raises ``InvalidRequest`` for a request the worker refuses, and an
        ``HTTPRefusal`` for one the server turns away (its load, its shutdown,
        an id in flight), before anything reaches the engine.
        """
        ...


class HTTPRefusal(Exception):
    """A request the server turned away, with the status and headers it answers with."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})

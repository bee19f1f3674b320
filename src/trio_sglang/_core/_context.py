"""The caller's handle on a request: its public id and the stop/kill switches."""

from __future__ import annotations

import trio

__all__ = ["RequestContext", "attach", "detach"]


class RequestContext:
    """The caller-visible side of one request.

    ``id`` is what the caller's client knows the request by (an OpenAI
    ``chatcmpl-...`` id, say); it is the public id on every chunk unless the
    request carries its own ``rid``. ``stop()`` (the client asked to stop) and
    ``kill()`` (the client is gone) are synchronous so that they can be called
    from anywhere in the trio run: a disconnect callback, another task, the
    consumer itself. Either one ends every stream opened with this context at
    once, and the engine-side cleanup goes on in the worker; a stream opened
    with a context that is already stopped or killed ends before anything
    reaches the engine.
    """

    __slots__ = ("_id", "_killed", "_scopes", "_stopped")

    def __init__(self, id: str) -> None:
        if not isinstance(id, str) or not id:
            raise ValueError("RequestContext id must be a non-empty string")
        self._id = id
        self._stopped = False
        self._killed = False
        self._scopes: set[trio.CancelScope] = set()

    @property
    def id(self) -> str:
        return self._id

    @property
    def stopped(self) -> bool:
        """True once ``stop()`` was called."""
        return self._stopped

    @property
    def killed(self) -> bool:
        """True once ``kill()`` was called."""
        return self._killed

    @property
    def cancelled(self) -> bool:
        """True once either ``stop()`` or ``kill()`` was called."""
        return self._stopped or self._killed

    def stop(self) -> None:
        """The client asked to stop generating: end the stream, stop the engine."""
        self._stopped = True
        self._cancel_streams()

    def kill(self) -> None:
        """The client is gone: end the stream, stop the engine."""
        self._killed = True
        self._cancel_streams()

    def _cancel_streams(self) -> None:
        for scope in self._scopes:
            scope.cancel()

    def __repr__(self) -> str:
        state = "killed" if self._killed else "stopped" if self._stopped else "active"
        return f"RequestContext({self._id!r}, {state})"


# The worker's side of a context, friends of ``RequestContext`` in its own module:
# while a stream's block is open, ``stop()`` and ``kill()`` cancel its scope.


def attach(ctx: RequestContext, scope: trio.CancelScope) -> None:
    """``scope`` ends with the context: at once if it already has."""
    ctx._scopes.add(scope)
    if ctx.cancelled:
        scope.cancel()


def detach(ctx: RequestContext, scope: trio.CancelScope) -> None:
    ctx._scopes.discard(scope)

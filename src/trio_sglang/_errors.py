"""The exceptions a caller of trio-sglang can see."""

from __future__ import annotations

__all__ = ["EngineError", "EngineShutdown", "InvalidRequest"]


class InvalidRequest(ValueError):
    """The request was rejected before anything reached the engine.

    A ``ValueError`` so that callers which already map ``ValueError`` to a
    client error (HTTP 400) do the right thing without knowing this library.
    """


class EngineShutdown(Exception):
    """The worker shut down while this stream was open (or before it opened).

    Raised out of ``worker.generate(...)``: the engine-side request has been
    handed to the worker's cleanup, exactly as for a stop.
    """


class EngineError(RuntimeError):
    """The engine failed this request: its stream raised, or went silent.

    Raised out of the caller's stream in place of the engine's own exception
    (kept as ``__cause__``), so that a caller catches one type whatever the
    engine. The message names the public id only; the worker has already
    logged the fault once, with the internal ids, and stopped the request at
    the engine exactly as for a stop.
    """

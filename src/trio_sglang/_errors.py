"""The exceptions a caller of trio-sglang can see."""

from __future__ import annotations

__all__ = ["EngineShutdown", "InvalidRequest"]


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

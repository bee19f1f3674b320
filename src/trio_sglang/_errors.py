"""The exceptions a caller of trio-sglang can see."""

from __future__ import annotations

__all__ = ["EngineError", "EngineShutdown", "InvalidRequest"]


class InvalidRequest(ValueError):
    """The request was rejected before anything reached the engine.

    A ``ValueError`` so that callers which already map ``ValueError`` to a
    client error (HTTP 400) do the right thing without knowing this library.
    ``param`` names the field at fault, when one is (``sampling_params.top_p``),
    in the caller's words: the server answers it as OpenAI's ``param``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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

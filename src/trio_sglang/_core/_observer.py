"""What the worker tells an observer (the server's metrics) as cleanup finishes."""

from __future__ import annotations

from typing import Protocol

from ._faults import EngineFault

__all__ = ["WorkerObserver"]


class WorkerObserver(Protocol):
    def cleanup_finished(self, seconds: float, *, released: bool) -> None:
        """One request's engine-side cleanup is over.

        ``seconds`` runs from the caller's leaving to the end of the cleanup;
        ``released`` says whether the engine had let go of every id of the
        request by then.
        """
        ...

    def engine_fault(self, kind: EngineFault) -> None:
        """The engine misbehaved once (see ``EngineFault``); already logged."""
        ...

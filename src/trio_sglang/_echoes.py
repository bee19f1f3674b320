"""``Echoes``: the ids an engine sent an abort for, and what its scheduler sent for them since.

One table per engine (``HearsScheduler``). The engine's abort path adds an
id, its output path tells the table every output of an id in it, and the
lifecycle reads and forgets each (``_core/_cleanup.py``). Most ids are read
and forgotten within a scheduler step or two; one nobody comes for (its
request's cleanup was cut, or the abort came from elsewhere than the
lifecycle) is dropped once the table holds ``limit`` ids, oldest first, so
that the table stays bounded whoever aborts.
"""

from __future__ import annotations

from ._engine import SchedulerEcho

__all__ = ["ECHOES_LIMIT", "Echoes"]

#: Ids an engine keeps echoes for at most.
ECHOES_LIMIT = 16_384


class Echoes:
    __slots__ = ("_echoes", "_limit")

    def __init__(self, limit: int = ECHOES_LIMIT) -> None:
        self._echoes: dict[str, SchedulerEcho] = {}
        self._limit = limit

    def __bool__(self) -> bool:
        """Whether any id is listened for (the output path skips its lookups if not)."""
        return bool(self._echoes)

    def sent(self, rid: str) -> None:
        """An abort of ``rid`` went to the scheduler: listen for it from now (once)."""
        if rid in self._echoes:
            return
        self._echoes[rid] = SchedulerEcho()
        if len(self._echoes) > self._limit:
            del self._echoes[next(iter(self._echoes))]

    def heard(self, rid: str, *, finished: bool) -> None:
        """The scheduler sent an output for ``rid``."""
        echo = self._echoes.get(rid)
        if echo is not None:
            echo.heard(finished=finished)

    def get(self, rid: str) -> SchedulerEcho | None:
        return self._echoes.get(rid)

    def forget(self, rid: str) -> None:
        self._echoes.pop(rid, None)

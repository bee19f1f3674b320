"""How a command ends: a refusal in one line, the status after a second signal."""

from __future__ import annotations

import sys

__all__ = ["BROKEN_PIPE_STATUS", "first", "forced_status", "refuse"]

#: How a shell reports a program that SIGPIPE ended (128 + 13), as ``demo | head`` expects.
BROKEN_PIPE_STATUS = 141


def refuse(message: str) -> int:
    """A configuration the server cannot run with: one line on stderr, and exit status 2."""
    print(message, file=sys.stderr)
    return 2


def forced_status(stopped: BaseExceptionGroup[BaseException]) -> int:
    """The exit status after a second signal: 128 + its number, as a shell reports it."""
    from ..server import ForcedShutdown

    found = first(stopped)
    assert isinstance(found, ForcedShutdown)
    return 128 + found.signum


def first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception a (nested) group holds."""
    found: BaseException = group
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    return found

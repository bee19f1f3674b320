"""Leaving a process that imported SGLang without the interpreter's teardown.

Once SGLang (and with it torch) is imported, Python's own exit takes about two
seconds of native teardown, paid at every close of the harness. The harness's
processes close what they hold themselves first, so there is nothing left for
that teardown to do.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["exit_at_once"]


def exit_at_once(status: int) -> NoReturn:
    """Flush stdout and stderr (the parent reads them) and end the process with ``status``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

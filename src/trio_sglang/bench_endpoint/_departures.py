"""The ways a client leaves, each with a clean close or a reset, and the control that stays.

A phase is named ``WHEN:HOW``: ``before_headers:reset``, ``mid_stream:close``;
``stay`` is the control. ``WHEN`` is a phase of the project's one vocabulary
(``trio_sglang._phases``), as the server's own metric names it. On the
command line a bare ``WHEN`` means both ``WHEN:close`` and ``WHEN:reset``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["ALL_PHASES", "LEAVES", "MEANING", "Leave", "Phase", "parse_phases"]

Leave = Literal["stay", "before_headers", "before_first_token", "first_token", "mid_stream"]
LEAVES: tuple[Leave, ...] = get_args(Leave)

#: What each way of leaving means, for the help.
MEANING = {
    "stay": "read to the end (the control: TTFT, ITL, the token count)",
    "before_headers": "close right after the request is sent, before any answer",
    "before_first_token": "close after --leave-delay, before the first token",
    "first_token": "close just after the first token",
    "mid_stream": "close after --mid-stream-chunks token events",
}


@dataclass(frozen=True, slots=True)
class Phase:
    leave: Leave
    #: Close with SO_LINGER 0: the kernel sends RST instead of FIN, as a client
    #: process that is killed, or a proxy that aborts, does.
    reset: bool = False

    @property
    def name(self) -> str:
        if self.leave == "stay":
            return "stay"
        return f"{self.leave}:{'reset' if self.reset else 'close'}"


ALL_PHASES: tuple[Phase, ...] = (
    Phase("stay"),
    *(Phase(leave, reset) for leave in LEAVES[1:] for reset in (False, True)),
)


def parse_phases(words: Sequence[str]) -> tuple[Phase, ...]:
    """``--phases``: each ``WHEN`` (both closes) or ``WHEN:close``/``WHEN:reset``, in run order."""
    chosen: list[Phase] = []
    for word in words:
        when, _, how = word.partition(":")
        if when not in LEAVES or how not in ("", "close", "reset") or (when == "stay" and how):
            raise ValueError(
                f"unknown phase {word!r}: one of {', '.join(LEAVES)}, each but stay "
                "optionally with :close or :reset"
            )
        leave = LEAVES[LEAVES.index(when)]  # the checked word, typed
        hows = [how == "reset"] if how or leave == "stay" else [False, True]
        chosen += [Phase(leave, reset) for reset in hows]
    return tuple(dict.fromkeys(chosen))

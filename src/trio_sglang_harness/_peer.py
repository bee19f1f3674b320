"""A disaggregated harness: the role under test, its queues' timing, and the peer script.

A prefill or decode engine never works alone: each request is paired, by its
``bootstrap_room``, with the other side's leg. The harness does not run the
other side; a fixed script plays it, the same on both sides of a conformance
comparison, so that what the engine under test does can be compared stage by
stage:

- role ``prefill`` (the peer is the decode side): ``peer_delay`` seconds
  after a request reaches the scheduler, the decode side's handshake on its
  room arrives; the peer never aborts.
- role ``decode`` (the peer is the prefill side): ``peer_delay`` seconds
  after the decode side's own handshake (which it makes
  ``timing.bootstrap_delay`` after the request reached it), the KV cache
  arrives, unless the decode side aborted the room first; then it never does.

The real TokenizerManager's stand-in scheduler plays the script inside its
own process (``_pd_queues.py``); ``play_peer`` plays it against a SimEngine's
``SimKVRooms``. The engine's own queues take ``timing`` on both sides.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import trio

from trio_sglang import Engine, RequestPhase
from trio_sglang.sim import DisaggregationMode, SimDisaggTiming, SimKVRooms

__all__ = ["DisaggSetup", "play_peer"]


@dataclass(frozen=True)
class DisaggSetup:
    """The role under test, its queues' timing, and the one delay of the peer script."""

    role: DisaggregationMode
    #: Seconds: see the module's docstring for what the peer does when.
    peer_delay: float
    timing: SimDisaggTiming = field(default_factory=SimDisaggTiming)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not 0 <= self.peer_delay < float("inf"):
            raise ValueError(
                f"peer_delay must be a finite number of seconds >= 0, got {self.peer_delay!r}"
            )

    def to_text(self) -> str:
        """As JSON, for a command line."""
        return json.dumps(asdict(self))

    @classmethod
    def from_text(cls, text: str) -> DisaggSetup:
        """From ``to_text``; ``ValueError`` if it is not one (so it is an argparse type)."""
        try:
            data = json.loads(text)
            return cls(data["role"], data["peer_delay"], SimDisaggTiming(**data["timing"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a DisaggSetup: {text!r}") from exc


async def play_peer(
    setup: DisaggSetup, engine: Engine, rooms: SimKVRooms, rid: str, room: int
) -> None:
    """The peer script for one request on a SimEngine whose rooms are ``rooms``.

    Unbounded on purpose: it waits on the request as the other side would,
    and whoever starts it cancels it when the scenario is over (a request
    released before dispatch never gets a peer).
    """
    phase = engine.phase(rid)
    while phase is not RequestPhase.DISPATCHED:
        phase = await engine.wait_phase_change(rid, phase)
    if setup.role == "prefill":
        await trio.sleep(setup.peer_delay)
        rooms.post(room, "decode_ready")
    elif "decode_ready" in await rooms.wait(room, frozenset({"decode_ready", "decode_aborted"})):
        with trio.move_on_after(setup.peer_delay) as kv_due:
            await rooms.wait(room, frozenset({"decode_aborted"}))
        if kv_due.cancelled_caught:
            rooms.post(room, "kv_sent")
    rooms.side_done(room)

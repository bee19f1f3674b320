"""Tools for testing a worker (or your own engine) against a misbehaving engine.

``FaultyEngine`` wraps any engine and injects the faults that a real
deployment meets: aborts that raise, hang or never take, streams that raise
or go silent, requests never registered, dispatch never observed, closes
that fail, and an engine that goes away with requests in flight.
"""

from ._faulty_engine import AbortFault, CloseFault, Faults, FaultyEngine

__all__ = ["AbortFault", "CloseFault", "Faults", "FaultyEngine"]

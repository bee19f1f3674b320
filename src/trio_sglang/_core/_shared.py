"""What every request of one worker shares: ``Shared``, made once by the worker.

A request's ``Lifecycle`` and its ``Cleanup`` read the engine, the policy and
the cleanup's owner from here rather than holding a copy each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._engine import Engine, EngineFeatures, HearsScheduler
from ._cleanup_group import CleanupGroup
from ._confirm import DEAF
from ._policy import AbortPolicy
from ._reports import Reports

__all__ = ["Shared", "shared_by_worker"]


@dataclass(frozen=True, slots=True)
class Shared:
    """What every request of one worker shares: made once, by the worker (``shared_by_worker``)."""

    engine: Engine
    policy: AbortPolicy
    #: The worker's owner of every engine-side task.
    group: CleanupGroup
    reports: Reports
    #: Whether closing the engine stream runs the engine's release path.
    release_on_close: bool
    #: The engine's release path aborts what was dispatched, and the engine
    #: honours one abort per request: after it, another abort is dropped.
    release_aborts_once: bool
    #: ``policy.stall_timeout``, or ``None`` where it bounds nothing.
    stall_timeout: float | None
    #: The engine, if it hears its scheduler.
    hears: HearsScheduler


def shared_by_worker(
    engine: Engine,
    features: EngineFeatures,
    policy: AbortPolicy,
    group: CleanupGroup,
    reports: Reports,
) -> Shared:
    """What a worker's requests share, from its engine, the engine's features and its policy."""
    return Shared(
        engine,
        policy,
        group,
        reports,
        features.release_on_close,
        features.release_on_close and features.abort_sent_flag,
        None if policy.stall_timeout == math.inf else policy.stall_timeout,
        engine if isinstance(engine, HearsScheduler) else DEAF,
    )

"""What ``SGLangEngine`` does where SGLang's own close leaves a cancelled request half-stopped.

From 0.5.20 closing ``generate_request`` forgets what was not dispatched and
aborts what was. Older releases leave parts of that undone
(``_semantics.CloseRelease``), and this module does them, so that
every supported release gives the lifecycle that one contract:

- **abort before close** (releases whose close does not abort): a dispatched,
  unfinished request is aborted *before* SGLang's close runs, while its state
  is still registered. 0.5.18 and 0.5.19 forget the state on close, after
  which ``abort_request`` drops the abort and the request decodes for nobody;
  0.5.16 and older keep it and send nothing. ``n > 1`` children (fresh uuids
  that only their first output reveals) are found by the sampling-params
  object they share with their parent, which each stream copies for itself;
- **forget what is left**, once the generator is dead (nothing can dispatch
  for it any more): a state never dispatched (0.5.16 and older keep the
  state of a request cancelled while tokenizing; 0.5.21 and older keep
  ``n - 1`` of an ``n > 1`` request's own states) or already finished (0.5.12
  and older keep a request aborted in the waiting queue). A dispatched,
  unfinished one is an *orphan*, forgotten once its abort has finished it.

Each step touches only states of this stream's own request (``states_of``),
so another request under a reused rid is never touched.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

__all__ = ["Orphans", "abort_dispatched", "dispatched", "forget_leftovers", "states_of"]

State = Any  # SGLang's ``ReqState``
Registry = MutableMapping[str, State]  # ``TokenizerManager.rid_to_state``


def dispatched(state: State) -> bool:
    """SGLang's dispatch mark, whichever the release has (``_semantics.DispatchMark``)."""
    return bool(
        getattr(state, "dispatched", False)
        or getattr(getattr(state, "time_stats", None), "api_server_dispatch_finish_time", 0)
    )


def states_of(registry: Registry, obj: Any, *, children: bool) -> list[tuple[str, State]]:
    """The registered states of the request ``obj`` (SGLang's ``GenerateReqInput``).

    A state is the request's if its own request shares one of ``obj``'s
    sampling-params objects (SGLang hands them down by reference, and each
    stream gives SGLang copies of its own): its own rids (one, or one per
    prompt and sample once SGLang normalised it) and, with ``children``, the
    ``n > 1`` children and the prefix warm-up, which only a scan finds.
    """
    params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    mine = {id(p) for p in params}

    def ours(state: State) -> bool:
        return id(getattr(state.obj, "sampling_params", None)) in mine

    rids = obj.rid if isinstance(obj.rid, list) else [obj.rid]
    found = [
        (rid, state)
        for rid in rids
        if isinstance(rid, str) and (state := registry.get(rid)) is not None and ours(state)
    ]
    if children and getattr(obj, "parallel_sample_num", 1) > 1:
        own = {rid for rid, _ in found}
        found += [(rid, s) for rid, s in registry.items() if rid not in own and ours(s)]
    return found


def abort_dispatched(
    tokenizer_manager: Any, states: Iterable[tuple[str, State]], sent: set[str]
) -> None:
    """Abort each dispatched, unfinished state not yet in ``sent`` (and add it there)."""
    for rid, state in states:
        if rid not in sent and dispatched(state) and not state.finished:
            sent.add(rid)
            tokenizer_manager.abort_request(rid=rid)


class Orphans:
    """Dispatched states whose generator is dead: forgotten once their abort finished them."""

    def __init__(self) -> None:
        self._rids: set[str] = set()

    def add(self, rid: str) -> None:
        self._rids.add(rid)

    def sweep(self, registry: Registry) -> None:
        """Forget every orphan that has finished (or that SGLang forgot itself)."""
        if not self._rids:
            return
        for rid in list(self._rids):
            state = registry.get(rid)
            if state is None or state.finished:
                self._rids.discard(rid)
                if state is not None:
                    del registry[rid]


def forget_leftovers(
    registry: Registry, states: Iterable[tuple[str, State]], orphans: Orphans
) -> None:
    """After the generator died: forget what can no longer be dispatched or has finished."""
    for rid, state in states:
        if dispatched(state) and not state.finished:
            orphans.add(rid)
        else:
            del registry[rid]

"""The SimEngine's tokenizer side: SGLang 0.5.23's ``TokenizerManager`` as far as aborts care.

What it reproduces, each something a cancellation lifecycle has to get right:
- a stream starts nothing until first pulled; then it registers the rid
  (a duplicate raises) before its first await, tokenizes (awaited), and
  dispatches, setting the dispatch timestamp;
- ``abort_request`` drops an unknown rid silently and sends at most one abort
  per state (``abort_sent``), even if the request is not dispatched yet, in
  which case the scheduler loses it;
- a cancelled pull or ``aclose`` forgets undispatched states and aborts
  dispatched ones (the ``except BaseException`` release path);
- a native batch registers ``rid_i`` (or the caller's list); ``n > 1``
  registers ``rid_i``, then awaits a warm-up request with its own uuid, swaps
  every child to a fresh uuid and sends the children one by one;
- a dispatched state stays registered until the scheduler's final output or
  abort echo removes it.

Beside SGLang's, what ``SGLangEngine`` adds around it (``HearsScheduler``):
every output of an id it sent an abort for is told to ``echoes``, and
``abort_again`` sends an abort past the once-only flag.
"""

from __future__ import annotations

import hashlib
import uuid
import zlib
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import trio

from .._echoes import Echoes
from .._engine import RequestPhase
from .._increments import IncrementQueue
from .._kv_rooms import BootstrapAddr
from ._prefix_cache import PrefixCache
from ._scheduler import VOCAB_SIZE, OutputSink, SimScheduler, SimTiming
from ._trace import Trace

__all__ = ["SchedulerFactory", "SimStream", "SimTokenizerManager"]

_WORDS = (
    "the a of to and in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these"
).split()
assert len(_WORDS) >= VOCAB_SIZE

#: SGLang's default ``max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 128

Deliver = Callable[["ReqState", dict[str, Any]], None]


class Prompt(NamedTuple):
    """One prompt, as the simulator sees it (words stand in for tokens)."""

    seed: int  # what its tokens are made from
    tokens: int
    key: Hashable  # what the prefix cache knows it by: its content and its cache_salt


@dataclass(slots=True, eq=False)
class ReqState:
    rid: str
    index: int | None  # position in a batch or among n samples; None for one prompt
    seed: int
    prompt_tokens: int
    max_new_tokens: int
    deliver: Deliver
    prompt_key: Hashable = None
    room: int | None = None  # bootstrap_room, for prefill/decode disaggregation
    at: BootstrapAddr | None = None  # bootstrap_host and bootstrap_port, likewise
    dispatch_time: float | None = None  # api_server_dispatch_finish_time
    abort_sent: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0  # set at dispatch, from the prefix cache


#: Builds the scheduler, given the path back to the tokenizer side.
SchedulerFactory = Callable[[OutputSink], SimScheduler]


class SimTokenizerManager:
    def __init__(
        self,
        timing: SimTiming,
        trace: Trace,
        release_on_close: bool,
        make_scheduler: SchedulerFactory | None = None,
        missed_aborts: int = 0,
    ) -> None:
        self.timing = timing
        self.trace = trace
        self.release_on_close = release_on_close
        self.rid_to_state: dict[str, ReqState] = {}
        self.echoes = Echoes()
        self.scheduler = (
            SimScheduler(timing, trace, self._on_output, missed_aborts)
            if make_scheduler is None
            else make_scheduler(self._on_output)
        )
        self.prefix_cache = PrefixCache()
        self.running = False
        self._waiters: dict[str, trio.lowlevel.ParkingLot] = {}
        self._streams: set[SimStream] = set()

    # -- what the engine exposes ------------------------------------------

    def phase(self, rid: str) -> RequestPhase:
        state = self.rid_to_state.get(rid)
        if state is None:
            return RequestPhase.ABSENT
        return RequestPhase.REGISTERED if state.dispatch_time is None else RequestPhase.DISPATCHED

    async def wait_phase_change(self, rid: str, phase: RequestPhase) -> RequestPhase:
        while (current := self.phase(rid)) is phase:
            lot = self._waiters.setdefault(rid, trio.lowlevel.ParkingLot())
            try:
                await lot.park()
            finally:
                if not lot and self._waiters.get(rid) is lot:
                    del self._waiters[rid]
        return current

    def abort_request(self, rid: str) -> None:
        state = self.rid_to_state.get(rid)
        if state is None:
            self.trace.record("abort_dropped", rid, "unknown rid")
            return
        if state.abort_sent:
            self.trace.record("abort_dropped", rid, "abort already sent")
            return
        state.abort_sent = True
        self.trace.record("abort_requested", rid)
        self.echoes.sent(rid)
        self.scheduler.abort(rid)

    def abort_again(self, rid: str) -> None:
        """An abort straight to the scheduler, past ``abort_sent``."""
        self.trace.record("abort_resent", rid)
        self.scheduler.abort(rid)

    def generate_request(self, request: Mapping[str, Any]) -> SimStream:
        return SimStream(self, request)

    def close(self) -> None:
        """The engine stopped: wake every stream so that it raises."""
        self.running = False
        for stream in list(self._streams):
            stream.wake()

    # -- the registry ------------------------------------------------------

    def register(self, state: ReqState) -> None:
        if state.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID: {state.rid}")
        self.rid_to_state[state.rid] = state
        self.trace.record("registered", state.rid)
        self._wake(state.rid)

    def dispatch(self, state: ReqState) -> None:
        state.dispatch_time = trio.current_time()
        state.cached_tokens = self.prefix_cache.dispatch(state.prompt_key, state.prompt_tokens)
        self.trace.record("dispatched", state.rid)
        self.scheduler.add_request(
            state.rid, state.seed, state.max_new_tokens, state.prompt_tokens, state.room, state.at
        )
        self._wake(state.rid)

    def release(self, state: ReqState) -> None:
        """Forget an undispatched state: nothing was ever sent for it."""
        if self.rid_to_state.get(state.rid) is state:
            del self.rid_to_state[state.rid]
            self.trace.record("released", state.rid)
            self._wake(state.rid)

    def holds(self, state: ReqState) -> bool:
        return self.rid_to_state.get(state.rid) is state

    def _wake(self, rid: str) -> None:
        lot = self._waiters.get(rid)
        if lot is not None:
            lot.unpark_all()

    def _on_output(
        self, rid: str, token_ids: list[int], finish_reason: dict[str, Any] | None
    ) -> None:
        if self.echoes:
            self.echoes.heard(rid, finished=finish_reason is not None)
        state = self.rid_to_state.get(rid)
        if state is None:
            return
        state.completion_tokens += len(token_ids)
        out: dict[str, Any] = {
            "text": "".join(" " + _WORDS[t] for t in token_ids),
            "output_ids": token_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish_reason,
                "prompt_tokens": state.prompt_tokens,
                "completion_tokens": state.completion_tokens,
                "cached_tokens": state.cached_tokens,
            },
        }
        if state.index is not None:
            out["index"] = state.index
        if finish_reason is not None:
            del self.rid_to_state[rid]
            self._wake(rid)
        state.deliver(state, out)


class SimStream:
    """``generate_request(obj)`` for one request: lazy, and released when abandoned.

    Slotted, and parked on trio's lowest-level wait rather than a ``ParkingLot``
    of its own: an open stream costs the collector four objects fewer, which a
    burst of 10,000 cancelled streams feels.
    """

    __slots__ = (
        "_closed",
        "_outputs",
        "_pulling",
        "_request",
        "_started",
        "_states",
        "_submitted",
        "_tm",
        "_unfinished",
        "_waiter",
    )

    def __init__(self, tm: SimTokenizerManager, request: Mapping[str, Any]) -> None:
        self._tm = tm
        self._request = request
        self._started = False
        self._pulling = False
        self._closed = False
        self._submitted = False
        self._unfinished = 0
        self._states: list[ReqState] = []
        # A child's backlog is handed over as one output, as SGLang's TokenizerManager does.
        self._outputs = IncrementQueue()
        #: The pulling task while it waits for an output (one pull at a time).
        self._waiter: trio.lowlevel.Task | None = None

    def __aiter__(self) -> SimStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._closed:
            raise StopAsyncIteration
        if self._pulling:
            raise RuntimeError("anext(): asynchronous generator is already running")
        self._pulling = True
        ok = False
        try:
            if not self._started:
                self._started = True
                self._tm._streams.add(self)
                await self._submit()
            while not self._outputs:
                if self._submitted and not self._unfinished:
                    self._finish()
                    raise StopAsyncIteration
                if not self._tm.running:
                    raise trio.ClosedResourceError("the SimEngine is not running")
                await self._wait()
            ok = True
        finally:
            self._pulling = False
            if not ok and not self._closed:
                self._release()
        return self._outputs.popleft()

    async def aclose(self) -> None:
        if self._pulling:
            # As with SGLang's async generator: a pull in progress must be
            # cancelled, not closed from under it.
            raise RuntimeError("aclose(): asynchronous generator is already running")
        if not self._closed:
            self._release()
        await trio.lowlevel.checkpoint()

    def wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)

    async def _wait(self) -> None:
        self._waiter = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abandon_wait)

    def _abandon_wait(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None  # cancelled: ``wake`` must not reschedule it
        return trio.lowlevel.Abort.SUCCEEDED

    def _finish(self) -> None:
        self._closed = True
        self._tm._streams.discard(self)

    def _release(self) -> None:
        """SGLang's release path for every state this stream created."""
        self._finish()
        self._outputs.clear()
        if not self._tm.release_on_close:
            return
        for state in self._states:
            if not self._tm.holds(state):
                continue
            if state.dispatch_time is None:
                self._tm.release(state)
            else:
                self._tm.abort_request(state.rid)

    def _deliver(self, state: ReqState, out: dict[str, Any]) -> None:
        if self._closed:
            return
        self._outputs.put(out)
        if out["meta_info"]["finish_reason"] is not None:
            self._unfinished -= 1
        self.wake()

    async def _submit(self) -> None:
        if not self._tm.running:
            raise trio.ClosedResourceError("the SimEngine is not running")
        request = self._request
        timing = self._tm.timing
        rid = request["rid"]
        prompts, batch = _prompts(request)
        sampling = request.get("sampling_params") or {}
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        n = per_prompt[0].get("n") or 1
        max_new = [_max_new_tokens(p) for p in per_prompt]
        multi = batch or n > 1
        count = len(prompts) * n
        if isinstance(rid, list):
            if len(rid) != len(prompts):
                raise ValueError(
                    f"The specified rids length mismatch with the batch_size: "
                    f"{len(rid)} rids for {len(prompts)} prompts"
                )
            rids = list(rid) if n == 1 else [f"{r}_{j}" for r in rid for j in range(n)]
        elif multi:
            rids = [f"{rid}_{i}" for i in range(count)]
        else:
            rids = [rid]
        states = [
            self._new_state(r, i if multi else None, prompts[i // n], max_new[i // n])
            for i, r in enumerate(rids)
        ]
        rooms, hosts, ports = (
            _per_prompt(request.get(f"bootstrap_{name}"), len(prompts))
            for name in ("room", "host", "port")
        )
        room = request.get("bootstrap_room")
        for i, state in enumerate(states):
            # SGLang: a scalar room on an expanded request is room + i per child.
            state.room = room + i if isinstance(room, int) and multi else rooms[i // n]
            host, port = hosts[i // n], ports[i // n]
            state.at = _NOWHERE if host is None and port is None else BootstrapAddr(host, port)
        for state in states:  # registration comes before any await
            self._tm.register(state)
        await trio.sleep(timing.tokenize_delay)
        if n > 1:
            await self._warm_up(prompts[0])
            children = []
            for i, state in enumerate(states):
                self._tm.release(state)
                child = self._new_state(uuid.uuid4().hex, i, prompts[i // n], state.max_new_tokens)
                child.room, child.at = state.room, state.at
                self._tm.register(child)
                children.append(child)
            states = children
        self._unfinished = len(states)
        for state in states:
            await trio.sleep(timing.dispatch_delay)
            self._tm.dispatch(state)
        self._submitted = True

    async def _warm_up(self, prompt: Prompt) -> None:
        done = trio.Event()
        state = ReqState(
            uuid.uuid4().hex,
            None,
            prompt.seed,
            prompt.tokens,
            0,
            lambda _s, _o: done.set(),
            prompt_key=prompt.key,
        )
        self._states.append(state)
        self._tm.register(state)
        self._tm.dispatch(state)
        await done.wait()

    def _new_state(
        self, rid: str, index: int | None, prompt: Prompt, max_new_tokens: int
    ) -> ReqState:
        seed = prompt.seed + 104729 * (index or 0)  # samples of one prompt differ
        state = ReqState(rid, index, seed, prompt.tokens, max_new_tokens, self._deliver, prompt.key)
        self._states.append(state)
        return state


#: A request without bootstrap fields: one address for all of them.
_NOWHERE = BootstrapAddr()


def _per_prompt(value: Any, prompts: int) -> list[Any]:
    """A bootstrap field as SGLang reads it: one value per prompt, or one for all."""
    return value if isinstance(value, list) else [value] * prompts


def _digest(salt: object) -> bytes | None:
    """What the prefix cache keeps of a ``cache_salt``: 32 bytes, however long the salt
    (the cache holds 1024 prompts' keys: a megabyte salt each would be a gigabyte)."""
    return None if salt is None else hashlib.sha256(str(salt).encode()).digest()


def _max_new_tokens(sampling: Mapping[str, Any]) -> int:
    value = sampling.get("max_new_tokens")
    return DEFAULT_MAX_NEW_TOKENS if value is None else int(value)


def _prompts(request: Mapping[str, Any]) -> tuple[list[Prompt], bool]:
    """Each prompt, and whether the request is a native batch. Words stand in for tokens."""
    text = request.get("text")
    contents: list[tuple[int, int, int]]  # seed, tokens, checksum
    if text is not None:
        texts = text if isinstance(text, list) else [text]
        batch = texts is text
        contents = [(crc := zlib.crc32(t.encode()), len(t.split()) or 1, crc) for t in texts]
    else:
        ids = request["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        contents = [
            (sum(p), len(p), zlib.crc32(repr(p).encode())) for p in (ids if batch else [ids])
        ]
    salts = _per_prompt(request.get("cache_salt"), len(contents))  # as many (the worker checks)
    return [
        Prompt(seed, n, (crc, n, _digest(salt)))
        for (seed, n, crc), salt in zip(contents, salts, strict=True)
    ], batch

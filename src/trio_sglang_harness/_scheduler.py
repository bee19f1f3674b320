"""A stand-in for SGLang's scheduler and detokenizer, as a process, for the real TokenizerManager.

The real SGLang scheduler needs a GPU (its CPU backend needs a CPU build of
``sgl_kernel`` that no package ships), but the real ``TokenizerManager`` runs
on any machine. This process takes the scheduler's (and detokenizer's) place
on the same ZMQ sockets and speaks SGLang's own messages, so the cancellation
lifecycle can be tested against the real TokenizerManager on a CPU-only
machine::

    python -m trio_sglang_harness._scheduler --first-token-delay S \\
        --token-interval S --log PATH [--disagg JSON]

It reads its sockets from stdin, as one JSON line ``{"input": IPC, "output":
IPC}``, once it has imported SGLang: so a parent starts it before the
TokenizerManager has its sockets, and the two processes import SGLang (about
ten seconds each) at once.

It PULLs ``TokenizedGenerateReqInput`` and ``AbortReq`` from the tokenizer
manager's ``scheduler_input_ipc_name`` and PUSHes ``BatchStrOutput`` and
``AbortReq`` echoes to its ``tokenizer_ipc_name``. It keeps SGLang's abort
semantics, the ones this project exists to handle: an abort stops every held
request whose rid starts with the abort's rid (or all, with ``abort_all``),
each stop is echoed back as an ``AbortReq`` carrying that request's rid (as
the real scheduler does for a queued request, which finishes it in
``TokenizerManager._handle_abort_req``), and an abort that matches nothing is
lost: there is no tombstone, so its request, arriving later, runs to the end.

With ``--disagg`` (a ``DisaggSetup`` as JSON) it is the scheduler of a
prefill or decode server: each request first goes through that role's
queues (``_pd_queues.py``), the other side of its bootstrap room played by
the setup's peer script.

Every event goes to ``--log`` as one flushed JSON line, ``{"t":
time.monotonic(), "kind": ..., "rid": ...}`` plus details; ``time.monotonic``
is system-wide on Linux, so the parent can set these times against its own.
Kinds: ``ready``, ``request`` (with the prompt's ``input_ids``), ``token``,
``finished``, ``abort``, ``abort_applied``, ``abort_lost``, ``ignored``
(another message type) and ``exit``; in a disaggregated role also
``bootstrapped``, ``prefill_chunk``, ``kv_sent``, ``kv_received`` and
``kv_timeout``, and ``abort_applied`` says in which ``stage`` a queued
request was.

zmq and sglang are imported inside functions, so the harness package imports
without the sglang extra; only running this process needs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from ._exit import exit_at_once
from ._pd_queues import Exit, Queues, queues_for
from ._peer import DisaggSetup
from ._wire import batch_str_output, receive, round_trip, send

if TYPE_CHECKING:
    import zmq

__all__ = ["Options", "main", "parse_args"]

#: What the real scheduler would use when a request sets no ``max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 128
#: The longest the loop blocks without looking at the stop flag and the parent.
_MAX_WAIT = 0.02
_SECONDS_PER_MS = 1e-3


@dataclass(frozen=True, slots=True)
class Options:
    """The command line, checked: every duration is a finite number of seconds >= 0."""

    first_token_delay: float
    token_interval: float
    log: Path
    poll_interval: float = 0.0005
    #: A prefill or decode server's scheduler; ``None``: aggregated.
    disagg: DisaggSetup | None = None


@dataclass(slots=True)
class _Held:
    """A request the scheduler holds: it decodes one token each time ``due`` passes."""

    rid: str
    http_worker_ipc: str | None
    prompt_tokens: int
    max_new_tokens: int
    due: float
    emitted: int = 0

    @property
    def done(self) -> bool:
        return self.emitted >= self.max_new_tokens


@dataclass(frozen=True, slots=True)
class _Step:
    """One request's share of a ``BatchStrOutput``: its new token (if any) and finish."""

    held: _Held
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    #: The finish reason, if not reaching ``max_new_tokens``.
    reason: dict[str, Any] | None = None


class _EventLog:
    """Appends one JSON object per event to a file, flushed at once.

    Flushed per line because the parent reads the log while this process runs
    and must see an event as soon as it happened, and because a process killed
    with SIGKILL must not lose what it already did.
    """

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def write(self, kind: str, rid: str | None, at: float | None = None, **details: Any) -> None:
        """``at``: when it happened, if not now (a token is decoded before it is sent)."""
        record = {"t": time.monotonic() if at is None else at, "kind": kind, "rid": rid, **details}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _StopFlag:
    """Set by SIGTERM or SIGINT; the loop checks it at least every ``_MAX_WAIT`` seconds.

    The handler only sets a flag (it raises nothing), so a signal can never
    interrupt a send halfway or skip closing the sockets and the log.
    """

    def __init__(self) -> None:
        self.reason: str | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.reason = signal.Signals(signum).name


def _duration(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """Read the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(
        prog="python -m trio_sglang_harness._scheduler",
        description="Stand-in SGLang scheduler for the real TokenizerManager (testing only).",
    )
    parser.add_argument("--first-token-delay", type=_duration, required=True, metavar="S")
    parser.add_argument("--token-interval", type=_duration, required=True, metavar="S")
    parser.add_argument("--log", type=Path, required=True, help="JSON-lines event log (appended)")
    parser.add_argument("--poll-interval", type=_duration, default=0.0005, metavar="S")
    parser.add_argument(
        "--disagg",
        type=DisaggSetup.from_text,
        metavar="JSON",
        help="a DisaggSetup: prefill or decode",
    )
    ns = parser.parse_args(argv)
    return Options(
        first_token_delay=ns.first_token_delay,
        token_interval=ns.token_interval,
        log=ns.log,
        poll_interval=ns.poll_interval,
        disagg=ns.disagg,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run until SIGTERM or SIGINT (or until the parent is gone); return the exit status."""
    parent = os.getppid()  # first: importing sglang takes seconds, the parent may die meanwhile
    options = parse_args(argv)
    log = _EventLog(options.log)
    try:
        _self_test()  # before connecting: never put a message on the wire SGLang cannot decode
        sockets = _sockets(sys.stdin)
        # Only now: until here (seconds of importing sglang) SIGTERM may kill outright,
        # as there is nothing to clean up yet.
        stop = _StopFlag()
        stop.install()
        return _Scheduler(options, sockets, log, stop, parent).run()
    finally:
        log.close()


def _sockets(stdin: IO[str]) -> tuple[str, str]:
    """The IPC names to PULL from and PUSH to, from the parent: the TokenizerManager's
    ``scheduler_input_ipc_name`` and ``tokenizer_ipc_name``.

    A parent that dies before naming them closes stdin, which ends the wait.
    """
    line = stdin.readline()
    if not line:
        raise SystemExit("stdin closed before the sockets were named")
    named = json.loads(line)
    return str(named["input"]), str(named["output"])


def _self_test() -> None:
    """Round-trip one of each message this process sends through SGLang's own codec.

    A message the TokenizerManager cannot decode, or one missing a field it
    indexes, crashes its receive loop, whose handler kills the whole process
    tree. If this SGLang version added a required field or changed a type,
    fail here, loudly, before connecting.
    """
    from sglang.srt.managers.io_struct import AbortReq, BatchStrOutput

    held = _Held("self-test", None, prompt_tokens=2, max_new_tokens=1, due=0.0)
    samples = (
        _batch_str_output([_Step(held, (3,), " w3", finished=True)]),
        _abort_echo("self-test", None, finished_reason=None),
    )
    for sample, kind in zip(samples, (BatchStrOutput, AbortReq), strict=True):
        decoded = round_trip(sample)
        if not isinstance(decoded, kind) or decoded != sample:
            raise RuntimeError(f"{kind.__name__} does not survive SGLang's codec: {decoded!r}")


class _Scheduler:
    """The loop: take messages as they arrive, emit tokens as they fall due."""

    def __init__(
        self,
        options: Options,
        sockets: tuple[str, str],
        log: _EventLog,
        stop: _StopFlag,
        parent: int,
    ) -> None:
        self._options = options
        #: The IPC names to PULL from and PUSH to.
        self._sockets = sockets
        self._log = log
        self._stop = stop
        self._held: dict[str, _Held] = {}  # insertion order = arrival order
        #: A disaggregated role's queues, which requests go through first.
        self._queues: Queues[_Held] | None = (
            None if options.disagg is None else queues_for(options.disagg, log)
        )
        #: Exit once reparented, so a crashed test run leaves no scheduler behind.
        self._parent = parent

    def run(self) -> int:
        import zmq

        context = zmq.Context()
        inbox = context.socket(zmq.PULL)
        outbox = context.socket(zmq.PUSH)
        try:
            inbox.connect(self._sockets[0])
            outbox.connect(self._sockets[1])
            self._log.write("ready", None, pid=os.getpid())
            reason = self._loop(inbox, outbox)
            queued = 0 if self._queues is None else len(self._queues.rids())
            self._log.write("exit", None, reason=reason, held=len(self._held) + queued)
        finally:
            # linger=0: on the way out nothing unsent is worth blocking exit for.
            inbox.close(linger=0)
            outbox.close(linger=0)
            context.term()
        return 0

    def _loop(self, inbox: zmq.Socket[bytes], outbox: zmq.Socket[bytes]) -> str:
        while True:
            if self._stop.reason is not None:
                return self._stop.reason
            if os.getppid() != self._parent:
                return "parent exited"
            self._wait_for_input(inbox)
            self._drain(inbox, outbox)
            self._emit_due(outbox)

    def _wait_for_input(self, inbox: zmq.Socket[bytes]) -> None:
        """Block until a message arrives or the next token falls due, whichever is first.

        zmq's poll wakes at once for a message but counts its timeout in whole
        milliseconds, so waits longer than a millisecond are spent in it; the
        sub-millisecond rest is slept in ``poll_interval`` steps, which bounds
        how late a token (or, in that short window, a message) is seen.
        """
        wait = _MAX_WAIT
        next_due = min((held.due for held in self._held.values()), default=math.inf)
        if self._queues is not None:
            next_due = min(next_due, self._queues.next_due())
        if next_due < math.inf:
            wait = min(wait, max(0.0, next_due - time.monotonic()))
        whole_ms = int(wait / _SECONDS_PER_MS)
        if whole_ms >= 1:
            inbox.poll(whole_ms)
        elif wait > 0:
            time.sleep(min(wait, self._options.poll_interval))

    def _drain(self, inbox: zmq.Socket[bytes], outbox: zmq.Socket[bytes]) -> None:
        """Apply every message already waiting, in arrival order."""
        import zmq

        while True:
            try:
                message = receive(inbox, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(message, outbox)

    def _apply(self, message: object, outbox: zmq.Socket[bytes]) -> None:
        from sglang.srt.managers.io_struct import (
            AbortReq,
            BatchTokenizedGenerateReqInput,
            TokenizedGenerateReqInput,
        )

        if isinstance(message, TokenizedGenerateReqInput):
            self._admit(message, outbox)
        elif isinstance(message, BatchTokenizedGenerateReqInput):
            for request in message.batch:
                self._admit(request, outbox)
        elif isinstance(message, AbortReq):
            self._abort(message, outbox)
        else:
            self._log.write("ignored", getattr(message, "rid", None), type=type(message).__name__)

    def _admit(self, request: Any, outbox: zmq.Socket[bytes]) -> None:
        """Hold a new request: first token after ``first_token_delay``, or queue it first.

        A duplicate rid replaces the request held under it (the TokenizerManager
        refuses duplicate rids, so this only happens if a rid is reused after
        its request ended).
        """
        now = time.monotonic()
        limit = request.sampling_params.max_new_tokens
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS if limit is None else int(limit)
        input_ids = request.input_ids
        held = _Held(
            rid=request.rid,
            http_worker_ipc=request.http_worker_ipc,
            prompt_tokens=0 if input_ids is None else len(input_ids),
            max_new_tokens=max_new_tokens,
            due=now + self._options.first_token_delay,
        )
        # What the model would be fed (the chat conformance compares it).
        prompt = [int(i) for i in input_ids or ()]
        if self._queues is None:
            self._held[request.rid] = held
            self._log.write("request", request.rid, max_new_tokens=max_new_tokens, input_ids=prompt)
            return
        room = request.bootstrap_room
        self._log.write(
            "request", request.rid, max_new_tokens=max_new_tokens, input_ids=prompt, room=room
        )
        exit = self._queues.admit(held, held.rid, room, held.prompt_tokens, now)
        if exit is not None:
            self._leave_queues(exit, outbox, now)

    def _abort(self, abort: Any, outbox: zmq.Socket[bytes]) -> None:
        """Stop every held request the abort matches (prefix rule); no tombstone if none."""
        prefix: str = abort.rid or ""
        self._log.write("abort", prefix, abort_all=bool(abort.abort_all))
        queues = self._queues
        queued = [] if queues is None else queues.rids()
        hits = [rid for rid in (*queued, *self._held) if abort.abort_all or rid.startswith(prefix)]
        if not hits:
            self._log.write("abort_lost", prefix)
            return
        for rid in hits:
            if rid in self._held:
                held = self._held.pop(rid)
                send(outbox, _abort_echo(rid, held.http_worker_ipc, abort.finished_reason))
                self._log.write("abort_applied", rid, abort_rid=prefix, tokens=held.emitted)
            elif queues is not None and (exit := queues.abort(rid)) is not None:
                self._leave_queues(exit, outbox, time.monotonic())

    def _leave_queues(self, exit: Exit[_Held], outbox: zmq.Socket[bytes], now: float) -> None:
        """Answer a request that left the queues, or start decoding it."""
        held = exit.request
        if exit.kind == "decode":
            held.due = now + self._options.first_token_delay
            self._held[held.rid] = held
        elif exit.kind == "echo":
            send(outbox, _abort_echo(held.rid, held.http_worker_ipc, finished_reason=None))
        elif exit.kind == "failed":
            send(outbox, _batch_str_output([_Step(held, (), "", True, exit.reason)]))
        else:  # prefilled: the token its forward sampled, and SGLang's length 0
            held.emitted = 1
            token_id = _token_id(held.emitted)
            step = _Step(held, (token_id,), f" w{token_id}", True, {"type": "length", "length": 0})
            send(outbox, _batch_str_output([step]))
            self._log.write("finished", held.rid, tokens=held.emitted)

    def _emit_due(self, outbox: zmq.Socket[bytes]) -> None:
        """Decode one step for every request that is due, as one batch, like a decode step."""
        now = time.monotonic()
        if self._queues is not None:
            for exit in self._queues.advance(now):
                self._leave_queues(exit, outbox, now)
        steps = [_step(held) for held in self._held.values() if held.due <= now]
        if not steps:
            return
        send(outbox, _batch_str_output(steps))
        for step in steps:
            held = step.held
            if step.token_ids:
                self._log.write("token", held.rid, at=now, index=held.emitted)
            if step.finished:
                del self._held[held.rid]
                self._log.write("finished", held.rid, tokens=held.emitted)
            else:
                held.due = now + self._options.token_interval


def _step(held: _Held) -> _Step:
    """Advance ``held`` by one decode step.

    A request with ``max_new_tokens == 0`` (SGLang's prefix warm-up for
    ``n > 1``) finishes at its first step with no token, as the real one does.
    """
    if held.done:
        return _Step(held, (), "", finished=True)
    held.emitted += 1
    token_id = _token_id(held.emitted)
    return _Step(held, (token_id,), f" w{token_id}", finished=held.done)


def _token_id(index: int) -> int:
    """Deterministic small ids (3.. past the tiny tokenizer's special tokens)."""
    return 3 + (index - 1) % 64


def _batch_str_output(steps: Sequence[_Step]) -> Any:
    """A ``BatchStrOutput`` of the installed release, lists aligned with ``rids`` (``_wire.py``).

    The TokenizerManager indexes ``rids``, ``finished_reasons``, ``output_strs``,
    ``output_ids``, the token counters and ``retraction_counts`` per request, so
    those carry real values; every other field what its type admits.
    """
    count = len(steps)
    zeros = [0] * count
    return batch_str_output(
        count,
        {
            "rids": [step.held.rid for step in steps],
            "http_worker_ipcs": [step.held.http_worker_ipc for step in steps],
            "finished_reasons": [_finish_reason(step) for step in steps],
            "output_strs": [step.text for step in steps],
            "output_ids": [array("i", step.token_ids) for step in steps],
            "prompt_tokens": [step.held.prompt_tokens for step in steps],
            "completion_tokens": [step.held.emitted for step in steps],
            "reasoning_tokens": zeros,
            "cached_tokens": zeros,
            "retraction_counts": zeros,
        },
    )


def _finish_reason(step: _Step) -> dict[str, Any] | None:
    """The step's own reason, else SGLang's ``FINISH_LENGTH(...).to_json()`` on the last step."""
    if not step.finished:
        return None
    if step.reason is not None:
        return step.reason
    return {"type": "length", "length": step.held.max_new_tokens}


def _abort_echo(rid: str, http_worker_ipc: str | None, finished_reason: Any) -> Any:
    """The ``AbortReq`` the real scheduler sends back for a request it dropped.

    Like its ``_make_abort_req``: the dropped request's own rid (not the abort's
    prefix) and the abort's ``finished_reason``; the TokenizerManager then
    finishes that request with an abort reason and forgets it.
    """
    from sglang.srt.managers.io_struct import AbortReq

    return AbortReq(rid=rid, http_worker_ipc=http_worker_ipc, finished_reason=finished_reason)


if __name__ == "__main__":
    exit_at_once(main())  # the sockets and the log are closed

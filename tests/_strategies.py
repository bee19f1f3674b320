"""What one lifecycle fuzz example runs, and the hypothesis strategies that draw it.

A ``Scenario`` is plain data (frozen dataclasses of numbers and strings), so a
falsifying example prints as something a person can read and paste into an
explicit regression test. The strategies shrink towards the simplest case:
one single-prompt request, zero delays, no cancel, no shutdown.

Cancel and shutdown moments are drawn as sixteenths of how long the engine
would take to finish the request (or every request), so whatever the timings,
they fall before the first pull, while tokenizing, while dispatching,
mid-stream or after the end in about the same proportions; with every delay
zero they all fall in one clock instant, and ``checkpoints`` (extra
scheduling points before acting) spreads them over trio's run batches instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from hypothesis import strategies as st

import trio_sglang as ts

Method = Literal[
    "none",  # read to the end and leave
    "stop",  # ctx.stop() from another task, at cancel_at
    "kill",  # ctx.kill() from another task, at cancel_at
    "break",  # leave the block after after_chunks chunks
    "aclose",  # await chunks.aclose() in the consumer after after_chunks chunks
    "raise",  # an exception in the block's body after after_chunks chunks
    "aclose_other",  # await chunks.aclose() from another task, at cancel_at
    "consumer_cancelled",  # the consumer's own task is cancelled at cancel_at
    "deadline",  # a move_on_at inside the block (the consumer gives up), at cancel_at
]
Shape = Literal["single", "n", "batch", "batch_n"]

METHODS: tuple[Method, ...] = (
    "none",
    "stop",
    "kill",
    "break",
    "aclose",
    "raise",
    "aclose_other",
    "consumer_cancelled",
    "deadline",
)
#: Cancels that land at a clock time, whatever the consumer is doing then.
TIMED: frozenset[Method] = frozenset(
    {"stop", "kill", "aclose_other", "consumer_cancelled", "deadline"}
)
#: The consumer leaves on its own after reading ``after_chunks`` chunks.
COUNTED: frozenset[Method] = frozenset({"break", "aclose", "raise"})
#: Consumers that stay in the block after the stream ends, until cancelled,
#: so that a cancel after the end still finds them there.
LINGERING: frozenset[Method] = frozenset({"stop", "kill", "consumer_cancelled", "deadline"})
#: Timed methods that can act before the block is even opened (a context
#: stopped, or a task cancelled, before ``generate``); aclose needs a stream.
BEFORE_OPEN: frozenset[Method] = frozenset({"stop", "kill", "consumer_cancelled", "deadline"})

#: Engine delays in seconds: zero (every step in one clock instant), a fast
#: engine, and slow ones; 0.25 and 1.0 are exact in binary, so sums of them tie.
DELAYS = (0.0, 0.001, 0.25, 1.0)
#: How long a consumer works before its first pull and after each chunk.
WORK = (0.0, 0.001, 0.25, 1.0)
#: Caller rids, shared by the requests of an example: two requests may name
#: the same rid, and "rid-a" is a prefix of "rid-ab" (SGLang aborts by
#: prefix), harmless only because the worker never hands them to the engine.
CALLER_RIDS = ("rid-a", "rid-ab", "rid-b")
MAX_REQUESTS = 8
MAX_NEW_TOKENS = 6
#: Moments are k/16 of a length, k in [0, MOMENT_STEPS]: the last 4 are past the end.
MOMENT_STEPS = 20
#: A grace longer than any cleanup's bound in the tests' policy: nothing is cut short.
LONG_GRACE = 60.0


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """The ``SimEngine``'s knobs."""

    tokenize_delay: float = 0.0
    dispatch_delay: float = 0.0
    first_token_delay: float = 0.0
    token_interval: float = 0.0
    release_on_close: bool = True

    def kwargs(self) -> dict[str, Any]:
        return {
            "tokenize_delay": self.tokenize_delay,
            "dispatch_delay": self.dispatch_delay,
            "first_token_delay": self.first_token_delay,
            "token_interval": self.token_interval,
            "release_on_close": self.release_on_close,
        }


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request, its consumer's pace, and how (and when) it leaves."""

    index: int
    output: ts.OutputMode = "tokens"
    #: Prompts of a native batch (``text`` or ``input_ids`` a list); None: one prompt.
    prompts: int | None = None
    n: int = 1
    input_ids: bool = False
    #: ``max_new_tokens`` per prompt (one entry for a single prompt).
    max_new_tokens: tuple[int, ...] = (1,)
    #: A batch's ``sampling_params`` as a list, one mapping per prompt.
    per_prompt_params: bool = False
    caller_rid: str | tuple[str, ...] | None = None
    #: Seconds after the example starts that the consumer opens its block.
    start_delay: float = 0.0
    #: Seconds the consumer works before its first pull, and after each chunk.
    pre_work: float = 0.0
    work: float = 0.0
    method: Method = "none"
    #: Timed methods: seconds after the consumer starts; None: before the block opens.
    cancel_at: float | None = 0.0
    #: Counted methods: chunks read before leaving.
    after_chunks: int = 0
    #: Extra scheduling points the canceller passes before acting.
    checkpoints: int = 0

    @property
    def shape(self) -> Shape:
        if self.prompts is None:
            return "single" if self.n == 1 else "n"
        return "batch" if self.n == 1 else "batch_n"

    @property
    def children(self) -> int:
        """Output streams the engine runs: prompts times samples."""
        return (self.prompts or 1) * self.n

    @property
    def context_id(self) -> str:
        return f"ctx-{self.index}"

    @property
    def public_id(self) -> str:
        """What text chunks must carry: the caller's rid, else the context id."""
        return self.caller_rid if isinstance(self.caller_rid, str) else self.context_id

    def public_child_ids(self) -> tuple[str, ...]:
        """The ``meta_info.id`` each child's native chunks must carry, by output index.

        README's rule, written out again here rather than imported, so that the
        test checks the library instead of agreeing with it: one sample is
        named by the public id; a child by the caller's rid list entry
        (``<entry>_<sample>`` when ``n > 1``), else ``<public id>_<index>``.
        """
        if self.prompts is None and self.n == 1:
            return (self.public_id,)
        if isinstance(self.caller_rid, tuple):
            return tuple(
                entry if self.n == 1 else f"{entry}_{j}"
                for entry in self.caller_rid
                for j in range(self.n)
            )
        return tuple(f"{self.public_id}_{k}" for k in range(self.children))

    def max_new_for(self, child: int) -> int:
        """``max_new_tokens`` of the child at output index ``child`` (``prompt * n + sample``)."""
        return self.max_new_tokens[child // self.n]

    @property
    def total_chunks(self) -> int:
        """Chunks an uncancelled run yields: one per token, or one empty final chunk."""
        return sum(max(1, self.max_new_for(k)) for k in range(self.children))

    def body(self) -> dict[str, Any]:
        """The SGLang ``/generate`` body this plan sends."""
        count = self.prompts or 1
        if self.input_ids:
            prompts: list[Any] = [[self.index + 1, p + 1, 7] for p in range(count)]
        else:
            prompts = [f"request {self.index} prompt {p}" for p in range(count)]
        params: list[dict[str, Any]] = [
            {"max_new_tokens": m, **({"n": self.n} if self.n > 1 else {})}
            for m in self.max_new_tokens
        ]
        prompt_field = "input_ids" if self.input_ids else "text"
        body: dict[str, Any] = {
            prompt_field: prompts[0] if self.prompts is None else prompts,
            "sampling_params": params if self.per_prompt_params else params[0],
        }
        if self.caller_rid is not None:
            body["rid"] = (
                list(self.caller_rid) if isinstance(self.caller_rid, tuple) else self.caller_rid
            )
        return body

    def natural_length(self, engine: EnginePlan) -> float:
        """How long the engine would take to finish this request, from the consumer's start.

        Its first pull comes after ``pre_work``; the ``n > 1`` warm-up takes
        one more first token delay. A slower consumer reads buffered outputs
        after that, but moments that matter to the engine lie in this span.
        """
        warm_up = engine.first_token_delay if self.n > 1 else 0.0
        return (
            self.pre_work
            + engine.tokenize_delay
            + warm_up
            + self.children * engine.dispatch_delay
            + engine.first_token_delay
            + max(self.max_new_tokens) * engine.token_interval
        )


@dataclass(frozen=True, slots=True)
class Scenario:
    """One fuzz example: an engine, requests sent at once, maybe a worker shutdown."""

    engine: EnginePlan
    requests: tuple[RequestPlan, ...]
    #: Seconds after the example starts that the worker is left; None: once
    #: every consumer is done.
    shutdown_at: float | None = None
    shutdown_checkpoints: int = 0
    shutdown_grace: float = LONG_GRACE


def moment(length: float) -> st.SearchStrategy[float]:
    """A time in [0, 1.25 * length]: k/16 of ``length``, the last quarter after the end."""
    return st.integers(0, MOMENT_STEPS).map(lambda k: length * k / 16)


def engine_plans() -> st.SearchStrategy[EnginePlan]:
    delays = st.sampled_from(DELAYS)
    return st.builds(
        EnginePlan,
        tokenize_delay=delays,
        dispatch_delay=delays,
        first_token_delay=delays,
        token_interval=delays,
        release_on_close=st.booleans(),
    )


@st.composite
def request_plans(draw: st.DrawFn, index: int, engine: EnginePlan) -> RequestPlan:
    shape: Shape = draw(st.sampled_from(("single", "n", "batch", "batch_n")))
    prompts = None if shape in ("single", "n") else draw(st.integers(1, 3))
    n = 1 if shape in ("single", "batch") else draw(st.integers(2, 4))
    count = prompts or 1
    per_prompt = prompts is not None and draw(st.booleans())
    tokens = st.integers(0, MAX_NEW_TOKENS)
    max_new = (
        tuple(draw(st.lists(tokens, min_size=count, max_size=count)))
        if per_prompt
        else (draw(tokens),) * count
    )
    rid_choices: list[st.SearchStrategy[str | tuple[str, ...] | None]] = [
        st.none(),
        st.sampled_from(CALLER_RIDS),
    ]
    if prompts is not None:
        # Distinct entries, as SGLang requires: the first ``prompts`` of an ordering.
        entries = st.permutations(CALLER_RIDS).map(lambda order: tuple(order[:prompts]))
        rid_choices.append(entries)
    plan = RequestPlan(
        index=index,
        output=draw(st.sampled_from(("tokens", "text", "native"))),
        prompts=prompts,
        n=n,
        input_ids=draw(st.booleans()),
        max_new_tokens=max_new,
        per_prompt_params=per_prompt,
        caller_rid=draw(st.one_of(rid_choices)),
        start_delay=draw(st.sampled_from((0.0, 0.0, 0.001, 0.25))),
        pre_work=draw(st.sampled_from(WORK)),
        work=draw(st.sampled_from(WORK)),
        method=draw(st.sampled_from(METHODS)),
    )
    if plan.method in TIMED:
        before_open = plan.method in BEFORE_OPEN and draw(st.integers(0, 15)) == 0
        cancel_at = None if before_open else draw(moment(plan.natural_length(engine)))
        return replace(plan, cancel_at=cancel_at, checkpoints=draw(st.integers(0, 2)))
    if plan.method in COUNTED:
        return replace(plan, after_chunks=draw(st.integers(0, plan.total_chunks + 1)))
    return plan


@st.composite
def scenarios(
    draw: st.DrawFn, *, graces: tuple[float, ...] = (LONG_GRACE,), always_shut_down: bool = False
) -> Scenario:
    """Up to ``MAX_REQUESTS`` requests sent at once, and sometimes a worker shutdown."""
    engine = draw(engine_plans())
    count = draw(st.integers(1, MAX_REQUESTS))
    requests = tuple(draw(request_plans(i, engine)) for i in range(count))
    grace = draw(st.sampled_from(graces))
    shutdown_at: float | None = None
    if always_shut_down or draw(st.booleans()):
        horizon = max(r.start_delay + r.natural_length(engine) for r in requests)
        shutdown_at = draw(moment(horizon))
    return Scenario(
        engine=engine,
        requests=requests,
        shutdown_at=shutdown_at,
        shutdown_checkpoints=draw(st.integers(0, 2)),
        shutdown_grace=grace,
    )

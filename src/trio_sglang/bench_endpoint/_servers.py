"""Which server is behind a metrics page, and what its metrics can and cannot say.

Each kind names the gauges whose sum is "requests in flight" and the counter
of generated tokens, with the limits each server's own code puts on them.
The names come from each project's source: SGLang's scheduler and tokenizer
metrics collectors, vLLM's Prometheus stat logger (v1), Dynamo's frontend
metrics, and this project's ``trio-sglang serve``. Anything a kind cannot
measure is said in ``limits``, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._prometheus import Series, metric_names

__all__ = ["KINDS", "ServerKind", "custom_kind", "detect_kind", "kind_from_option"]


@dataclass(frozen=True, slots=True)
class ServerKind:
    name: str
    #: Summed: every state in which the server holds a request.
    in_flight: tuple[Series, ...]
    tokens: Series | None
    #: Whose requests the gauges count: "engine" (the scheduler's), "frontend"
    #: (the HTTP handlers', which end when the client is noticed gone, whatever
    #: the engine does), or "unknown" (named with --metrics).
    holds: str
    #: What the gauges or the counter cannot show on this server, and why.
    limits: tuple[str, ...] = ()
    #: The counter can miss tokens made for a client that left: what it shows is
    #: a lower bound of them.
    tokens_lower_bound: bool = False
    #: The gauges change only when the engine takes a step, so they can keep
    #: their last value once it has nothing left to run: after a burst of
    #: leaves, a short probe request makes it step once.
    stale_when_idle: bool = False
    #: Said after "the counter is not on the page", when it can be missing.
    tokens_hint: str = ""


_SGLANG_STATES = (
    "running_reqs",
    "queue_reqs",
    "grammar_queue_reqs",
    # Prefill/decode disaggregation: a request waits in one of these, not in the two above.
    "prefill_prealloc_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
)

SERVE = ServerKind(
    "serve",
    (Series("trio_sglang_engine_live_requests"),),
    Series("trio_sglang_sim_events_total", (("kind", "token"),)),
    holds="engine",
    tokens_hint=" (serve exports it on the SimEngine only, not with --engine sglang)",
)
SGLANG = ServerKind(
    "sglang",
    tuple(Series(f"sglang:num_{state}", breakdowns=("priority",)) for state in _SGLANG_STATES),
    Series("sglang:generation_tokens_total"),
    holds="engine",
    limits=(
        "SGLang sets its request gauges only when the scheduler logs its stats: at each "
        "prefill batch and every --decode-log-interval decode steps (40 by default), so a "
        "release shows up to that many steps late; start it with --decode-log-interval 1",
        "SGLang adds a request's generated tokens when its tokenizer side sees the request "
        "finish; a request whose client left may be forgotten there first and never "
        "counted, so tokens after leaving are a lower bound",
    ),
    tokens_lower_bound=True,
    stale_when_idle=True,
)
VLLM = ServerKind(
    "vllm",
    (Series("vllm:num_requests_running"), Series("vllm:num_requests_waiting")),
    Series("vllm:generation_tokens_total"),
    holds="engine",
    limits=(
        "vLLM sets its request gauges from each engine step's stats: an engine left with "
        "nothing to run takes no step, so the last release of a burst may show only when "
        "the next request runs (the probe's)",
        "vLLM counts tokens as its frontend reads the engine's outputs and skips those of "
        "a request it has already aborted: tokens the engine made after that abort are not "
        "counted, so tokens after leaving are a lower bound",
    ),
    tokens_lower_bound=True,
    stale_when_idle=True,
)
DYNAMO_FRONTEND = ServerKind(
    "dynamo-frontend",
    (Series("dynamo_frontend_inflight_requests"),),
    None,
    holds="frontend",
    limits=(
        "dynamo_frontend_inflight_requests counts the frontend's HTTP handlers, not the "
        "engine's requests: its drop says the frontend let go, not that the engine stopped "
        "(for the engine's own gauges, point --metrics-url at each worker's system port, "
        "DYN_SYSTEM_PORT, where Dynamo passes SGLang's and vLLM's metrics through)",
        "the frontend exports no generated-token counter: tokens after leaving are not measured",
    ),
)

#: In the order detection tries them: an engine's own gauges before a frontend's.
KINDS = {kind.name: kind for kind in (SERVE, SGLANG, VLLM, DYNAMO_FRONTEND)}


def detect_kind(page: str) -> ServerKind | None:
    """The first kind whose first in-flight gauge is on the page (a metrics page's text)."""
    names = metric_names(page)
    for kind in KINDS.values():
        if kind.in_flight[0].name in names:
            return kind
    return None


def custom_kind(spec: str) -> ServerKind:
    """``in_flight=A+B[,tokens=C]``: gauges summed, a counter; each a name or a selector."""
    fields: dict[str, str] = {}
    for part in _top_level_split(spec, ","):
        key, equals, value = part.partition("=")
        if not equals or key.strip() not in ("in_flight", "tokens") or not value.strip():
            raise ValueError(
                f"--metrics: expected a server kind ({', '.join(KINDS)}) or "
                f"'in_flight=NAME[+NAME...][,tokens=NAME]', got {spec!r}"
            )
        fields[key.strip()] = value.strip()
    if "in_flight" not in fields:
        raise ValueError(f"--metrics: no in_flight=NAME in {spec!r}")
    in_flight = tuple(Series.parse(name) for name in _top_level_split(fields["in_flight"], "+"))
    tokens = Series.parse(fields["tokens"]) if "tokens" in fields else None
    limits = (
        ()
        if tokens
        else ("no generated-token counter named: tokens after leaving are not measured",)
    )
    return ServerKind(
        "custom", in_flight, tokens, holds="unknown", limits=limits, stale_when_idle=True
    )


def kind_from_option(spec: str) -> ServerKind:
    """``--metrics``: a known kind by name, or gauges and a counter named."""
    return KINDS.get(spec) or custom_kind(spec)


def _top_level_split(text: str, separator: str) -> list[str]:
    """Split on ``separator`` outside label braces (a selector may hold commas)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts

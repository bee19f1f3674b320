"""Bodies a hostile or broken client sends, for ``test_http_bad_input.py``: hypothesis strategies.

The valid bodies each family starts from (``BASES``), the values that are
wrong at each field the server checks (``WRONG_VALUES``, drawn through
``SITES``), JSON that Python's ``json`` reads but JSON is not, and nesting
around the parser's limit.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from hypothesis import strategies as st

from trio_sglang._protocol._openai_fields import CHAT_FIELDS, COMPLETION_FIELDS
from trio_sglang._request._fields import SGLANG_FIELDS

MODEL = "trio-sglang-sim"
#: The server's body limit: a 100,000-deep ``{"a":...}`` (600 kB) fits under it.
MAX_BODY_BYTES = 1 << 20
GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (GENERATE, COMPLETIONS, CHAT)
#: Short valid bodies, which the families turn bad. Each holds "Hello" once.
VALID: dict[str, dict[str, Any]] = {
    GENERATE: {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
    COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
}
#: Every body the families start from, by name: the valid ones, and a native one of token ids.
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "generate": (GENERATE, VALID[GENERATE]),
    "generate_ids": (GENERATE, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
    "completions": (COMPLETIONS, VALID[COMPLETIONS]),
    "chat": (CHAT, VALID[CHAT]),
}
#: The fields each endpoint knows: SGLang's, sglang-router's bookkeeping fields among them.
KNOWN_FIELDS: dict[str, frozenset[str]] = {
    GENERATE: SGLANG_FIELDS,
    COMPLETIONS: COMPLETION_FIELDS,
    CHAT: CHAT_FIELDS,
}
ROLES = ("system", "developer", "user", "assistant", "tool")
INT32_MAX = 2**31 - 1
#: Past this many digits, Python's ``int()`` (and so ``json.loads``) raises ValueError.
INT_DIGIT_LIMIT = 4300


ENDPOINT = st.sampled_from(ENDPOINTS)


def json_scalars(ints: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    return (
        st.none()
        | st.booleans()
        | ints
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=10)
    )


def json_values(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=10), children, max_size=4)
        ),
        max_leaves=12,
    )


JSON_SCALARS = json_scalars(st.integers())
JSON_VALUES = json_values(JSON_SCALARS)
#: JSON values of each type, by JSON's names for them (null aside).
KINDS: dict[str, st.SearchStrategy[Any]] = {
    "bool": st.booleans(),
    "int": st.integers(),
    "float": st.floats(allow_nan=False, allow_infinity=False),
    "str": st.text(max_size=8),
    "array": st.lists(JSON_SCALARS, max_size=3),
    "object": st.dictionaries(st.text(max_size=4), JSON_SCALARS, max_size=3),
}
#: A string with half a surrogate pair: JSON can escape it, UTF-8 cannot encode it.
LONE_SURROGATE = st.builds(
    lambda before, half, after: before + half + after,
    st.text(max_size=4),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.text(max_size=4),
)
#: Ints that no float holds (``float()`` raises OverflowError).
TOO_BIG_FOR_A_FLOAT = st.builds(
    lambda sign, magnitude: sign * magnitude,
    st.sampled_from([1, -1]),
    st.integers(min_value=2**1024, max_value=10**400),
)


def other_than(*kinds: str) -> st.SearchStrategy[Any]:
    """JSON values of every type but ``kinds`` (never null, which reads as "not given")."""
    return st.one_of([values for kind, values in KINDS.items() if kind not in kinds])


def ints_outside(low: int, high: int | None = None) -> st.SearchStrategy[int]:
    below = st.integers(max_value=low - 1)
    return below if high is None else below | st.integers(min_value=high + 1)


def numbers_outside(low: int, high: int | None = None) -> st.SearchStrategy[Any]:
    """Finite floats and ints out of ``[low, high]``, ints past a float, and non-numbers."""
    # Not exclude_max: hypothesis counts -0.0 as below 0.0, and the server does not.
    floats = st.floats(max_value=math.nextafter(low, -math.inf), allow_infinity=False)
    if high is not None:
        floats |= st.floats(min_value=math.nextafter(high, math.inf), allow_infinity=False)
    ints = ints_outside(low, high)
    return floats | ints | TOO_BIG_FOR_A_FLOAT | other_than("int", "float")


BAD_PROMPT_TEXT = (
    other_than("str", "array")
    | st.just("")
    | st.just([])
    | LONE_SURROGATE
    | st.lists(LONE_SURROGATE, min_size=1)
    # Not ints or arrays: a completion's prompt may be token ids, or a batch of them.
    | st.lists(other_than("str", "int", "array"), min_size=1)
    | st.lists(st.just(""), min_size=1)
)
#: Non-empty lists that are no token ids: not all strings (a batch of prompts) either.
BAD_TOKEN_ID_LISTS = st.lists(
    ints_outside(0, INT32_MAX) | other_than("int", "str", "array"), min_size=1
) | st.lists(st.just([]), min_size=1)
BAD_STOP = other_than("str", "array") | st.lists(other_than("str"), min_size=1)
BAD_MAX_TOKENS = ints_outside(0, INT32_MAX) | other_than("int")
BAD_N = ints_outside(1, 1024) | other_than("int")
BAD_PENALTY = numbers_outside(-2, 2)
#: What a grammar is not: a string.
BAD_GRAMMAR = other_than("str")
#: Not a response_format SGLang's serving code maps.
BAD_RESPONSE_FORMAT = (
    other_than("object")
    | st.builds(
        lambda kind: {"type": kind}, st.text(max_size=8).filter(lambda t: t != "text")
    ).filter(lambda f: f["type"] not in ("json_object", "json_schema", "structural_tag"))
    | st.just({"type": "json_schema"})
    | st.just({"type": "json_schema", "json_schema": {"name": "x"}})
    | st.just({"type": "json_schema", "json_schema": {"schema": {}}})
    | st.just({"type": "structural_tag"})
)
#: Fields the SimEngine does not honour, set: refused by name.
NOT_ON_THE_SIM = st.text(min_size=1, max_size=8)
#: A token budget for OpenAI's completions, where SGLang wants at least 1.
BAD_COMPLETION_MAX_TOKENS = BAD_MAX_TOKENS | st.just(0)
#: Log probabilities and SGLang's response extensions, which the OpenAI routes do not return.
ASKS_FOR_TRUE = st.just(True)
#: Any name is served, as by SGLang; ``name:adapter`` asks for a LoRA adapter, which it has not.
BAD_MODEL = other_than("str") | st.text(max_size=8).map(lambda a: f"{MODEL}:{a}x")
BAD_ROLE = other_than("str") | st.text(max_size=8).filter(lambda role: role not in ROLES)
BAD_CONTENT = (
    other_than("str", "array")
    | LONE_SURROGATE
    | st.lists(other_than("object"), min_size=1)
    | st.lists(
        st.builds(lambda text: {"type": "text", "text": text}, other_than("str")), min_size=1
    )
    | st.just([{"type": "image_url", "image_url": {"url": "http://x"}}])
)

Field = tuple[str | int, ...]
#: Per base: a field of its body (or one to add) and values that are wrong there.
WRONG_VALUES: dict[str, dict[Field, st.SearchStrategy[Any]]] = {
    "generate": {
        ("text",): BAD_PROMPT_TEXT | st.lists(st.integers(0, 9), min_size=1),
        ("input_ids",): st.just([1, 2]),  # text and input_ids both
        ("sampling_params",): other_than("object"),
        ("sampling_params", "max_new_tokens"): BAD_MAX_TOKENS,
        ("sampling_params", "n"): BAD_N,
        ("sampling_params", "temperature"): numbers_outside(0),
        ("sampling_params", "top_p"): numbers_outside(0, 1) | st.just(0),
        ("sampling_params", "stop"): BAD_STOP,
        ("sampling_params", "min_new_tokens"): BAD_MAX_TOKENS | st.just(3),  # 3 > max_new 2
        ("sampling_params", "top_k"): st.integers(max_value=-2) | st.just(0) | other_than("int"),
        ("sampling_params", "min_p"): numbers_outside(0, 1),
        ("sampling_params", "repetition_penalty"): numbers_outside(0, 2) | st.just(0),
        ("sampling_params", "stop_regex"): BAD_STOP | st.sampled_from(["(", "a" * 257, "[z-a]"]),
        ("sampling_params", "regex"): BAD_GRAMMAR,
        ("sampling_params", "sampling_seed"): ints_outside(-(2**63), 2**63 - 1) | other_than("int"),
        ("sampling_params", "beam_width"): st.integers(2, 8),  # not on the SimEngine
        ("sampling_params", "is_normalized"): st.booleans(),  # SGLang's own
        ("return_logprob",): st.just(True),  # not on the SimEngine
        ("image_data",): NOT_ON_THE_SIM,
        ("lora_path",): NOT_ON_THE_SIM,
        ("priority",): other_than("int"),
        ("input_embeds",): st.just([[0.5, 0.5]]),  # refused everywhere
        ("rid",): other_than("str") | st.just(""),
        ("stream",): other_than("bool"),
    },
    "generate_ids": {
        ("input_ids",): other_than("array") | st.just([]) | BAD_TOKEN_ID_LISTS,
        ("sampling_params", "max_new_tokens"): BAD_MAX_TOKENS,
    },
    "completions": {
        ("model",): BAD_MODEL,
        ("prompt",): BAD_PROMPT_TEXT | BAD_TOKEN_ID_LISTS,
        ("n",): BAD_N,
        ("temperature",): numbers_outside(0),
        ("top_p",): numbers_outside(0, 1) | st.just(0),
        ("presence_penalty",): numbers_outside(-2, 2),
        ("frequency_penalty",): numbers_outside(-2, 2),
        ("stop",): BAD_STOP,
        ("seed",): ints_outside(-(2**63), 2**63 - 1) | other_than("int"),
        ("stream",): other_than("bool"),
        ("stream_options",): other_than("object"),
        ("stream_options", "include_usage"): other_than("bool"),
        ("ignore_eos",): other_than("bool"),
        ("echo",): st.just(True),
        ("best_of",): ints_outside(1, 1) | other_than("int"),
        ("max_tokens",): BAD_COMPLETION_MAX_TOKENS,
        ("min_tokens",): BAD_MAX_TOKENS | st.just(3),  # 3 > max_tokens 2
        ("top_k",): st.just(0) | other_than("int"),
        ("repetition_penalty",): numbers_outside(0, 2) | st.just(0),
        ("json_schema",): BAD_GRAMMAR,
        ("response_format",): BAD_RESPONSE_FORMAT,
        ("logprobs",): st.integers(0, 5),
        ("return_hidden_states",): ASKS_FOR_TRUE,
        ("return_token_ids",): ASKS_FOR_TRUE,
        ("lora_path",): NOT_ON_THE_SIM,
        ("user",): other_than("str"),
        ("rid",): other_than("str") | st.just(""),
    },
    "chat": {
        ("model",): BAD_MODEL,
        ("messages",): other_than("array") | st.just([]),
        ("messages", 0): other_than("object"),
        ("messages", 0, "role"): BAD_ROLE,
        ("messages", 0, "content"): BAD_CONTENT,
        ("max_tokens",): BAD_MAX_TOKENS,
        ("max_completion_tokens",): BAD_MAX_TOKENS,
        ("n",): BAD_N,
        ("temperature",): numbers_outside(0),
        ("stop",): BAD_STOP,
        ("stream",): other_than("bool"),
        ("logprobs",): st.just(True),
        ("top_logprobs",): st.integers(1, 20),
        ("presence_penalty",): BAD_PENALTY,
        ("min_p",): numbers_outside(0, 1),
        ("response_format",): BAD_RESPONSE_FORMAT,
        ("input_ids",): other_than("array") | st.just([]) | BAD_TOKEN_ID_LISTS,
        ("tools",): st.just([{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice",): st.just("required"),
        ("chat_template_kwargs",): st.just({"enable_thinking": True}),
        ("return_meta_info",): ASKS_FOR_TRUE,
        ("separate_reasoning",): other_than("bool"),
        ("lora_path",): NOT_ON_THE_SIM,
    },
}


def replaced(body: Any, field: Field, value: object) -> Any:
    """A copy of ``body`` with ``value`` at ``field`` (a path of keys and indexes)."""
    if not field:
        return value
    key, *rest = field
    if isinstance(body, list):
        items = list(body)
        items[int(key)] = replaced(body[int(key)], tuple(rest), value)
        return items
    return {**body, key: replaced(body.get(key, {}), tuple(rest), value)}


def encoded(body: object) -> bytes:
    return json.dumps(body).encode()


def with_raw_json(body: dict[str, Any], field: Field, raw: str) -> bytes:
    """``body`` as JSON, with ``raw`` (JSON text, or what passes for it) at ``field``."""
    marker = "\0raw\0"
    return encoded(replaced(body, field, marker)).replace(json.dumps(marker).encode(), raw.encode())


@dataclasses.dataclass(frozen=True)
class Site:
    """A field the server validates, in one of the ``BASES``."""

    base: str
    field: Field

    @property
    def path(self) -> str:
        return BASES[self.base][0]

    @property
    def body(self) -> dict[str, Any]:
        return BASES[self.base][1]


SITES = st.sampled_from(
    [Site(base, field) for base, wrong in WRONG_VALUES.items() for field in wrong]
)


def nested(kind: str, depth: int) -> str:
    """``[[[...]]]`` or ``{"a":{"a":...0}}``, ``depth`` levels deep."""
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "0" + "}" * depth


NOT_JSON = st.sampled_from(["NaN", "Infinity", "-Infinity"]) | st.integers(
    INT_DIGIT_LIMIT + 1, 3 * INT_DIGIT_LIMIT
).map(lambda digits: "9" * digits)
#: Depths around where the parser gives up (Python's recursion limit, which hypothesis
#: raises to about 2,000 while a test runs), and far past it.
DEPTHS = st.integers(1, 2500) | st.integers(1, 100_000)

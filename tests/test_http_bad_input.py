"""Bad input over HTTP: hostile bodies get a clear 4xx, never a 5xx, and reach nothing.

``tests/test_bad_input.py`` holds the worker's side of the rule; this module
sends what a hostile or broken client can put on the wire to a real server
(``trio_sglang.server.serve`` on a ``SimEngine``, loopback, port 0), at
``/generate``, ``/v1/completions`` and ``/v1/chat/completions``. For every
body, hypothesis-drawn or written out:

- the status is never 5xx: a 4xx with an error body of OpenAI's shape (a
  message that says what is wrong, ``code`` a string or null), or a 200
  when the body happens to be valid, read to its end with no error in it;
- a rejected body reached nothing: the engine's trace gained no event and no
  rid is live; after a 200, nothing stays live either.

Families: JSON that is not an object; objects of random (known and unknown)
keys and random values; a valid body with one field turned wrong (type or
range, or a field the SimEngine or the server does not do); unknown fields
(ignored, as SGLang ignores them, but in ``/generate``'s ``sampling_params``,
where SGLang refuses them too); arbitrary bytes, invalid UTF-8, truncated JSON; what
Python's ``json`` reads but JSON is not, or what it cannot read without
raising something other than ``JSONDecodeError`` (``NaN``/``Infinity``, ints
past Python's digit limit, nesting past the recursion limit); bodies over the
server's limit, with and without a Content-Length. Bugs they found are pinned
by plain ``test_regression_*`` tests at the end.

The bodies are drawn by ``_bad_bodies.py``. One server runs for the whole
module, in a thread of its own (its own ``trio.run``), so the hypothesis
tests are plain sync functions posting with a sync httpx client; the engine
is read in the server's trio thread (through its ``TrioToken``), never
concurrently with it. The engine has no delays, and the valid bodies ask for
two tokens, so a 200 is cheap.

Budget: CI runs ``CI_EXAMPLES`` derandomized examples per family. With
``TRIO_SGLANG_FUZZ_EXAMPLES=N`` (as in ``test_fuzz_lifecycle.py``) the
families share N examples in proportion, from a fresh random seed::

    TRIO_SGLANG_FUZZ_EXAMPLES=20000 pytest tests/test_http_bad_input.py -q
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import trio_sglang as ts
from _bad_bodies import (
    CHAT,
    COMPLETIONS,
    DEPTHS,
    ENDPOINT,
    ENDPOINTS,
    GENERATE,
    JSON_SCALARS,
    JSON_VALUES,
    KNOWN_FIELDS,
    MAX_BODY_BYTES,
    MODEL,
    NOT_JSON,
    SITES,
    VALID,
    WRONG_VALUES,
    Field,
    Site,
    encoded,
    json_scalars,
    json_values,
    nested,
    replaced,
    with_raw_json,
)
from _fuzz import fuzz_settings
from trio_sglang._request._sampling import SAMPLING_PARAMS
from trio_sglang.server import ServerLimits, serve
from trio_sglang.server._asgi import DRAIN_BYTES, Message, read_json
from trio_sglang.server._http_errors import HTTPError

#: Examples per family in CI: fixed, derandomized, about 3,000 in all (a few seconds).
CI_EXAMPLES = {
    "test_json_that_is_not_an_object": 200,
    "test_objects_of_random_fields": 600,
    "test_one_field_made_wrong": 1000,
    "test_unknown_fields": 200,
    "test_arbitrary_bytes": 200,
    "test_invalid_utf8": 200,
    "test_truncated_json": 200,
    "test_what_json_loads_reads_but_json_is_not": 300,
    "test_deep_nesting": 200,
    "test_bodies_over_the_limit": 50,
}


def settings_for(test_name: str) -> settings:
    return fuzz_settings(CI_EXAMPLES, test_name)


# -- the server --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LiveServer:
    """A server running in another thread, and a way into its trio run."""

    url: str
    engine: ts.SimEngine
    token: trio.lowlevel.TrioToken = dataclasses.field(repr=False)

    def engine_state(self) -> tuple[int, set[str]]:
        """How many events the engine's trace holds, and its live rids."""
        return trio.from_thread.run_sync(
            lambda: (len(self.engine.trace), self.engine.live_rids()), trio_token=self.token
        )


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """One server for the module, stopped through ``shutdown`` (gracefully) at its end."""
    engine = ts.SimEngine(tokenize_delay=0, dispatch_delay=0, first_token_delay=0, token_interval=0)
    stop = trio.Event()
    ready: Future[LiveServer] = Future()

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                partial(
                    serve,
                    engine,
                    port=0,
                    model=MODEL,
                    limits=ServerLimits(max_body_bytes=MAX_BODY_BYTES),
                    handle_signals=False,
                    shutdown=stop,
                )
            )
            ready.set_result(LiveServer(urls[0], engine, trio.lowlevel.current_trio_token()))

    with ThreadPoolExecutor(max_workers=1) as pool:
        finished = pool.submit(trio.run, run)
        wait([ready, finished], timeout=30, return_when=FIRST_COMPLETED)
        if finished.done():
            finished.result()  # the server failed to start: raise its error
        live = ready.result(timeout=0)
        try:
            yield live
        finally:
            trio.from_thread.run_sync(stop.set, trio_token=live.token)
            finished.result(timeout=30)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def post(
    server: LiveServer, client: httpx.Client, path: str, content: bytes | Iterable[bytes]
) -> httpx.Response:
    """POST ``content`` (an iterable goes chunked, with no Content-Length) and check the answer.

    Whatever the body: no 5xx; a 4xx is a JSON error that reached nothing at
    the engine; a 200 is a whole answer with no error in it; and afterwards
    nothing is live at the engine. (A request the engine finishes leaves its
    registry before its last output, so before the answer ends: no wait.)
    """
    trace_before, _ = server.engine_state()
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    trace_after, live = server.engine_state()
    status = response.status_code
    assert status == 200 or 400 <= status < 500, response.text
    assert live == set(), "the request left rids live at the engine"
    if status == 200:
        for payload in _answer_payloads(response):
            assert "error" not in payload, payload
        return response
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["code"], str | None)
    assert trace_after == trace_before, "a rejected body reached the engine"
    return response


def _answer_payloads(response: httpx.Response) -> list[Any]:
    """The JSON payloads of a 200: its SSE events (the stream must end in [DONE]), or its body."""
    if response.headers["content-type"] != "text/event-stream":
        body = response.json()
        return body if isinstance(body, list) else [body]
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", response.text
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def assert_rejected(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


# -- the families --------------------------------------------------------------


@settings_for("test_json_that_is_not_an_object")
@given(path=ENDPOINT, value=JSON_SCALARS | st.lists(JSON_VALUES))
def test_json_that_is_not_an_object(
    server: LiveServer, client: httpx.Client, path: str, value: object
) -> None:
    response = post(server, client, path, encoded(value))
    assert_rejected(response, 400, "must be an object")


#: Small ints: a body that happens to be valid stays cheap (no n or max_tokens in the billions).
SMALL_JSON_VALUES = json_values(json_scalars(st.integers(-16, 16)))


@st.composite
def objects_of_random_fields(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """An endpoint, and an object of its own fields (and maybe an unknown one), random values.

    Half of them go over the endpoint's valid body, and the OpenAI endpoints
    mostly get the served model, so that many get past the first checks, and
    some are valid.
    """
    path = draw(ENDPOINT)
    body = dict(VALID[path]) if draw(st.booleans()) else {}
    body |= draw(st.dictionaries(st.sampled_from(sorted(KNOWN_FIELDS[path])), SMALL_JSON_VALUES))
    if draw(st.integers(0, 3)) == 0:
        body[draw(st.text(max_size=10))] = draw(SMALL_JSON_VALUES)
    if path != GENERATE and draw(st.integers(0, 3)) != 0:
        body["model"] = MODEL
    return path, body


@settings_for("test_objects_of_random_fields")
@given(case=objects_of_random_fields())
def test_objects_of_random_fields(
    server: LiveServer, client: httpx.Client, case: tuple[str, dict[str, Any]]
) -> None:
    path, body = case
    post(server, client, path, encoded(body))


@st.composite
def wrong_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """An endpoint, and a body of it with one field wrong."""
    site = draw(SITES)
    return site.path, replaced(site.body, site.field, draw(WRONG_VALUES[site.base][site.field]))


@settings_for("test_one_field_made_wrong")
@given(case=wrong_bodies(), stream=st.booleans())
def test_one_field_made_wrong(
    server: LiveServer, client: httpx.Client, case: tuple[str, Any], stream: bool
) -> None:
    path, body = case
    if stream and "stream" not in body:
        body["stream"] = True  # a wrong body is rejected before a stream starts, too
    response = post(server, client, path, encoded(body))
    assert response.status_code != 200, f"accepted a wrong body: {body!r}"


@settings_for("test_unknown_fields")
@given(
    path=ENDPOINT,
    key=st.text(min_size=1, max_size=12),
    value=JSON_VALUES,
    in_sampling_params=st.booleans(),
)
def test_unknown_fields(
    server: LiveServer,
    client: httpx.Client,
    path: str,
    key: str,
    value: object,
    in_sampling_params: bool,
) -> None:
    """An unknown field is ignored, as SGLang ignores it; in native sampling_params, a 400.

    SGLang's pydantic models (the OpenAI routes) and its ``/generate`` dataclass
    and contract check ignore unknown keys; its contract refuses an unknown
    sampling parameter, naming it.
    """
    in_sampling_params &= path == GENERATE
    known = set(SAMPLING_PARAMS) if in_sampling_params else KNOWN_FIELDS[path]
    assume(key not in known)
    field: Field = ("sampling_params", key) if in_sampling_params else (key,)
    response = post(server, client, path, encoded(replaced(VALID[path], field, value)))
    if in_sampling_params:
        assert_rejected(response, 400, repr(key))
        assert response.json()["error"]["param"] == f"sampling_params.{key}"
    else:
        assert response.status_code == 200, response.text


@settings_for("test_arbitrary_bytes")
@given(path=ENDPOINT, content=st.binary(max_size=64))
def test_arbitrary_bytes(
    server: LiveServer, client: httpx.Client, path: str, content: bytes
) -> None:
    post(server, client, path, content)


#: Byte sequences that are not UTF-8 between ASCII: a stray continuation byte,
#: never-valid bytes, an overlong "/", a cut euro sign, a surrogate, past U+10FFFF.
INVALID_UTF8 = (b"\x80", b"\xff", b"\xc0\xaf", b"\xe2\x82", b"\xed\xa0\x80", b"\xf4\x90\x80\x80")
ASCII_LETTERS = st.text(st.characters(min_codepoint=ord("a"), max_codepoint=ord("z")), max_size=4)


@settings_for("test_invalid_utf8")
@given(
    path=ENDPOINT,
    before=ASCII_LETTERS,
    bad=st.sampled_from(INVALID_UTF8),
    after=ASCII_LETTERS,
)
def test_invalid_utf8(
    server: LiveServer, client: httpx.Client, path: str, before: str, bad: bytes, after: str
) -> None:
    """A prompt that is not UTF-8: the body is not JSON text."""
    prompt = before.encode() + bad + after.encode()
    content = encoded(VALID[path]).replace(b"Hello", prompt)
    assert_rejected(post(server, client, path, content), 400, "malformed JSON body")


@st.composite
def truncated(draw: st.DrawFn) -> tuple[str, bytes]:
    """An endpoint, and a proper prefix (the empty one too) of a body, valid or not."""
    path, body = draw(wrong_bodies() | ENDPOINT.map(lambda path: (path, VALID[path])))
    content = encoded(body)
    return path, content[: draw(st.integers(0, len(content) - 1))]


@settings_for("test_truncated_json")
@given(case=truncated())
def test_truncated_json(server: LiveServer, client: httpx.Client, case: tuple[str, bytes]) -> None:
    path, content = case
    assert_rejected(post(server, client, path, content), 400, "malformed JSON body")


@settings_for("test_what_json_loads_reads_but_json_is_not")
@given(site=SITES, raw=NOT_JSON)
def test_what_json_loads_reads_but_json_is_not(
    server: LiveServer, client: httpx.Client, site: Site, raw: str
) -> None:
    """NaN and Infinity (Python's extensions) and ints past Python's digit limit, anywhere."""
    response = post(server, client, site.path, with_raw_json(site.body, site.field, raw))
    assert_rejected(response, 400, "malformed JSON body")


@settings_for("test_deep_nesting")
@given(
    site=SITES,
    kind=st.sampled_from(["array", "object"]),
    depth=DEPTHS,
    whole_body=st.booleans(),
)
def test_deep_nesting(
    server: LiveServer, client: httpx.Client, site: Site, kind: str, depth: int, whole_body: bool
) -> None:
    """Nesting at any depth, as the whole body (never a request) or as the value of a field.

    A nested value is not always wrong (a ``{"a": ...}`` of ``stream_options``
    is an object of options), so only ``post``'s invariants hold there.
    """
    raw = nested(kind, depth)
    if whole_body:
        assert post(server, client, site.path, raw.encode()).status_code == 400
    else:
        post(server, client, site.path, with_raw_json(site.body, site.field, raw))


@settings_for("test_bodies_over_the_limit")
@given(path=ENDPOINT, excess=st.integers(1, DRAIN_BYTES), chunked=st.booleans())
def test_bodies_over_the_limit(
    server: LiveServer, client: httpx.Client, path: str, excess: int, chunked: bool
) -> None:
    """A 413 for a body over the limit, sent with a Content-Length or chunked.

    Over by at most ``DRAIN_BYTES``, which the server reads to the end before
    it answers, so the client gets the answer (past that, see the last tests).
    """
    content = encoded(VALID[path])
    padding = MAX_BODY_BYTES + excess - len(content)
    content = content.replace(b"Hello", b"Hello" + b"x" * padding)
    chunks = (content[i : i + (1 << 16)] for i in range(0, len(content), 1 << 16))
    response = post(server, client, path, chunks if chunked else content)
    assert_rejected(response, 413, f"over {MAX_BODY_BYTES} bytes")


# -- what the server deliberately accepts ---------------------------------------

#: Fields sglang-router adds to every request it forwards (see tests/test_router.py).
ROUTER_BOOKKEEPING: dict[str, dict[str, Any]] = {
    GENERATE: {
        "model": None,
        "log_metrics": True,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    },
    COMPLETIONS: {
        "ignore_eos": False,
        "skip_special_tokens": True,
        "no_stop_trim": False,
        "return_hidden_states": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
    },
    CHAT: {
        "ignore_eos": False,
        "skip_special_tokens": True,
        "no_stop_trim": False,
        "return_hidden_states": False,
        "continue_final_message": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "max_completion_tokens": 2,
    },
}


@pytest.mark.parametrize("path", ENDPOINTS)
def test_router_bookkeeping_fields_are_accepted(
    server: LiveServer, client: httpx.Client, path: str
) -> None:
    body = {**VALID[path], **ROUTER_BOOKKEEPING[path]}
    assert post(server, client, path, encoded(body)).status_code == 200


# -- regressions: bugs these families found ---------------------------------------


@pytest.mark.parametrize("kind", ["array", "object"])
def test_regression_nesting_100000_deep_is_a_400(
    server: LiveServer, client: httpx.Client, kind: str
) -> None:
    """``json.loads`` raised RecursionError, which the server answered with a 500."""
    response = post(server, client, GENERATE, nested(kind, 100_000).encode())
    assert_rejected(response, 400, "nested too deeply")


def test_regression_int_past_the_digit_limit_is_a_400(
    server: LiveServer, client: httpx.Client
) -> None:
    """``json.loads`` raised ValueError (Python's int digit limit): a 500."""
    field = ("sampling_params", "max_new_tokens")
    content = with_raw_json(VALID[GENERATE], field, "1" * 5000)
    response = post(server, client, GENERATE, content)
    assert_rejected(response, 400, "Exceeds the limit")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_regression_nan_and_infinity_are_a_400(
    server: LiveServer, client: httpx.Client, constant: str
) -> None:
    """Python's ``json`` reads them, so a ``logit_bias`` of NaN went to the engine (a 200)."""
    field = ("sampling_params", "logit_bias", "1")
    response = post(server, client, GENERATE, with_raw_json(VALID[GENERATE], field, constant))
    assert_rejected(response, 400, f"{constant} is not a JSON value")


@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_regression_unhashable_chat_role_is_a_400(
    server: LiveServer, client: httpx.Client, role: object
) -> None:
    """The role was looked up in a set: TypeError (unhashable), a 500."""
    body = replaced(VALID[CHAT], ("messages", 0, "role"), role)
    assert_rejected(post(server, client, CHAT, encoded(body)), 400, "needs a role")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_regression_openai_number_too_big_for_a_float_is_a_400(
    server: LiveServer, client: httpx.Client, path: str
) -> None:
    """``math.isfinite(10**400)`` raised OverflowError: a 500."""
    body = replaced(VALID[path], ("temperature",), -(10**400))
    assert_rejected(post(server, client, path, encoded(body)), 400, "temperature must be")


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (GENERATE, ("text",)),
        (COMPLETIONS, ("prompt",)),
        (CHAT, ("messages", 0, "content")),
    ],
)
def test_regression_lone_surrogate_prompt_is_a_400(
    server: LiveServer, client: httpx.Client, path: str, field: Field
) -> None:
    """``"\\ud800"`` is valid JSON but not Unicode: the engine failed to encode it (a 5xx)."""
    body = replaced(VALID[path], field, "Hello \ud800")
    assert_rejected(post(server, client, path, encoded(body)), 400, "lone surrogate")


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (GENERATE, ("sampling_params", "max_new_tokens")),
        (GENERATE, ("rid",)),
        (COMPLETIONS, ("max_tokens",)),
        (COMPLETIONS, ("temperature",)),
    ],
)
def test_regression_value_nested_just_under_the_parser_limit_is_a_400(
    server: LiveServer, client: httpx.Client, path: str, field: Field
) -> None:
    """A value ``json.loads`` could still read, but ``repr`` (in the error) could not: a 500.

    The depths that parse but do not print lie just under the recursion
    limit, where exactly depends on the stack: every depth near it is tried.
    """
    limit = sys.getrecursionlimit()
    for depth in range(limit - 100, limit + 1):
        content = with_raw_json(VALID[path], field, nested("array", depth))
        assert post(server, client, path, content).status_code == 400


@pytest.mark.parametrize("options", [False, 0, ""])
def test_regression_falsy_stream_options_is_a_400(
    server: LiveServer, client: httpx.Client, options: object
) -> None:
    """``stream_options`` was read as ``body.get(...) or {}``: false passed as no options."""
    body = {**VALID[COMPLETIONS], "stream_options": options}
    assert_rejected(post(server, client, COMPLETIONS, encoded(body)), 400, "'stream_options'")


def test_regression_surrogate_encoded_in_utf8_is_a_400(
    server: LiveServer, client: httpx.Client
) -> None:
    """``json.loads`` decodes bytes with "surrogatepass": the engine failed on the text (a 5xx)."""
    content = encoded(VALID[GENERATE]).replace(b"Hello", b"Hello \xed\xa0\x80")
    assert_rejected(post(server, client, GENERATE, content), 400, "malformed JSON body")


async def test_regression_body_a_little_over_the_limit_is_read_to_its_end() -> None:
    """A chunked upload past the limit got "Server disconnected" instead of its 413.

    The server answered at the first byte over, and hypercorn then closed the
    connection with the rest of the body unread, a reset that can lose the
    answer. Now the body is read to its end first, up to ``DRAIN_BYTES`` over.
    """
    chunks: list[Message] = [{"type": "http.request", "body": b"x" * 1000, "more_body": True}] * 9
    chunks.append({"type": "http.request", "body": b"x" * 1000, "more_body": False})
    pending = iter(chunks)

    async def receive() -> Message:
        return next(pending)

    with pytest.raises(HTTPError) as raised:
        await read_json({"headers": []}, receive, limit=5000)
    assert raised.value.status == 413
    assert next(pending, None) is None


async def test_a_declared_length_past_what_is_drained_gets_its_413_at_once() -> None:
    async def receive() -> Message:
        pytest.fail("read a body that is declared too large to drain")

    scope = {"headers": [(b"content-length", str(5000 + DRAIN_BYTES + 1).encode())]}
    with pytest.raises(HTTPError) as raised:
        await read_json(scope, receive, limit=5000)
    assert raised.value.status == 413

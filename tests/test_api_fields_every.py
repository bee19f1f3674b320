"""Every field of each of SGLang's tables, on each OpenAI route: passed on as it is, mapped,
or refused by name, as ``_protocol/_openai_fields.py`` lists it (the servers of
``test_api_fields.py``)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import httpx
import pytest
import trio

import test_api_fields
import trio_sglang as ts
from test_api_fields import (
    CHAT,
    COMPLETION,
    FAST,
    MODEL,
    SGLANG_EXTRAS,
    SpyEngine,
    StartServer,
    refused,
)
from trio_sglang._protocol import _openai_fields
from trio_sglang._protocol._openai_fields import Route
from trio_sglang.server import serve

#: test_api_fields.py's fixture: servers on free loopback ports, stopped at the test's end.
start_server = test_api_fields.start_server

# -- every field of each table ----------------------------------------------------------------

ROUTES: dict[Route, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", COMPLETION),
    "chat": ("/v1/chat/completions", CHAT),
}
#: A valid value of each field passed to the engine as it is.
PASSED_VALUES: dict[str, Any] = {
    "lora_path": "adapter",
    "session_id": "s",
    "session_params": {"id": "s"},
    "custom_logit_processor": "{}",
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 1,
    "routed_dp_rank": 0,
    "data_parallel_rank": 0,
    "disagg_prefill_dp_rank": 0,
    "extra_key": "k",
    "cache_salt": "c",
    "priority": 1,
    "custom_labels": {"team": "a"},
}


class EveryFieldEngine(SpyEngine):
    """Lists no honoured fields, so it is passed every one, as SGLangEngine is."""

    def features(self) -> ts.EngineFeatures:
        return dataclasses.replace(super().features(), honoured_fields=None)


def asking(off: tuple[object, ...]) -> object:
    """A value that asks for something, where ``off`` are the values that ask for nothing."""
    if False in off:
        return True
    if 0 in off or 1 in off:
        return 2
    if "auto" in off:
        return "required"
    if [] in off:
        return [{"type": "function", "function": {"name": "f"}}]
    return "x"


@pytest.mark.parametrize(
    ("route", "key"),
    [(route, key) for route in ROUTES for key in sorted(_openai_fields._PASSED[route])],
)
async def test_every_passed_field_reaches_the_engine_as_sent(
    nursery: trio.Nursery, route: Route, key: str
) -> None:
    engine = EveryFieldEngine(**FAST)
    stop = trio.Event()
    urls = await nursery.start(
        partial(serve, engine, port=0, model=MODEL, handle_signals=False, shutdown=stop)
    )
    path, body = ROUTES[route]
    try:
        async with httpx.AsyncClient(base_url=urls[0]) as client:
            response = await client.post(path, json={**body, key: PASSED_VALUES[key]})
    finally:
        stop.set()
    assert response.status_code == 200, response.text
    assert engine.requests[-1][key] == PASSED_VALUES[key]


@pytest.mark.parametrize(
    ("route", "key"),
    [(route, key) for route in ROUTES for key in sorted(_openai_fields._UNSUPPORTED[route])],
)
async def test_every_unsupported_field_is_refused_past_its_default(
    start_server: StartServer, route: Route, key: str
) -> None:
    server = await start_server()
    path, body = ROUTES[route]
    off, why = _openai_fields._UNSUPPORTED[route][key]
    for value in off:
        response = await server.client.post(path, json={**body, key: value})
        assert response.status_code == 200, (key, value, response.text)
    error = await refused(server, path, {**body, key: asking(off)})
    assert error["message"] == f"'{key}' is not supported by this server: {why}"
    assert error["param"] == key


@pytest.mark.parametrize(
    ("route", "key"),
    [(route, key) for route in ROUTES for key in sorted(_openai_fields._IGNORED[route])],
)
async def test_every_ignored_field_is_checked_then_dropped(
    start_server: StartServer, route: Route, key: str
) -> None:
    server = await start_server()
    path, body = ROUTES[route]
    kind = _openai_fields._IGNORED[route][key]
    good = "someone" if kind is str else True
    response = await server.client.post(path, json={**body, key: good})
    assert response.status_code == 200, response.text
    assert key not in server.engine.requests[-1]
    error = await refused(server, path, {**body, key: 7})
    assert error["param"] == key


@pytest.mark.parametrize(
    ("route", "key"),
    [(route, key) for route in ROUTES for key in sorted(_openai_fields._SAMPLING[route])],
)
async def test_every_sampling_field_becomes_sglangs_parameter(
    start_server: StartServer, route: Route, key: str
) -> None:
    value = SAMPLING_VALUES[key]
    server = await start_server()
    path, body = ROUTES[route]
    response = await server.client.post(path, json={**body, key: value})
    assert response.status_code == 200, response.text
    assert server.sampling[_openai_fields._SAMPLING[route][key]] == value


#: A valid value of each OpenAI field that becomes a sampling parameter.
SAMPLING_VALUES: dict[str, Any] = {
    **{key: value for key, (value, _) in SGLANG_EXTRAS.items()},
    "temperature": 0.5,
    "top_p": 0.5,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "seed": 3,
    "n": 2,
    "stop": ["\n"],
    "ebnf": 'root ::= "a"',
    "json_schema": '{"type": "string"}',
    "logit_bias": {"1": 1.0},
}

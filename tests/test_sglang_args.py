"""SGLang's own server flags on ``serve`` and ``dynamo-worker``, parsed by SGLang's parser.

Needs SGLang importable (its parser is the one under test), not its engine:
marker ``real_engine``, in ``nox -s real-engine``. ``--device cpu`` is left
to the processes that start the engine: it must be seen before SGLang is
first imported, which a test runner has long done.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("sglang", reason="needs the sglang extra: run `nox -s real-engine`")

from trio_sglang._cli._parser import build_parser, engine_options, server_limits

pytestmark = pytest.mark.real_engine


def parsed(*argv: str) -> object:
    return build_parser(argv).parse_args(argv)


def test_a_flag_both_have_does_both_jobs_and_the_rest_go_to_sglang() -> None:
    args = parsed(
        "serve",
        "--engine",
        "sglang",
        "--model-path",
        "some/model",
        "--max-running-requests",
        "16",
        "--context-length",
        "256",
        "--api-key",
        "sk-1",
        "--served-model-name",
        "first",
        "--served-model-name",
        "alias",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.3",
        "--port",
        "0",
        "--host",
        "127.0.0.2",
    )
    assert engine_options(args).sglang_args == {
        "model_path": "some/model",
        "max_running_requests": 16,
        "context_length": 256,
        "api_key": "sk-1",
        "served_model_name": "first",  # SGLang takes one; the server keeps its aliases
        "tp_size": 2,
        "mem_fraction_static": 0.3,
    }  # not --host and --port: those place trio-sglang's own server
    limits = server_limits(args)
    assert (limits.max_running_requests, limits.context_length, limits.api_key) == (16, 256, "sk-1")


def test_flags_left_at_their_defaults_are_not_passed() -> None:
    args = parsed("serve", "--engine", "sglang", "--model-path", "m")
    assert engine_options(args).sglang_args == {"model_path": "m"}
    assert server_limits(args).max_running_requests == 2048  # the edge's own default


def test_dynamo_worker_takes_sglangs_flags_too() -> None:
    args = parsed(
        "dynamo-worker",
        "--model-name",
        "tiny",
        "--engine",
        "sglang",
        "--model-path",
        "m",
        "--chat-template",
        "chatml",
        "--disaggregation-mode",
        "null",
        "--tp-size",
        "2",
    )
    options = engine_options(args)
    assert options.sglang_args == {"model_path": "m", "chat_template": "chatml", "tp_size": 2}
    assert options.disaggregation_mode is None  # SGLang's "null": an aggregated worker


def test_sglangs_parser_refuses_what_sglang_refuses() -> None:
    with pytest.raises(SystemExit) as exit_info:
        parsed("serve", "--engine", "sglang", "--model-path", "m", "--attention-backend", "nope")
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--ssl-certfile", "/x.pem"], "--ssl-certfile"),
        (["--admin-api-key", "k"], "--admin-api-key"),
        (["--tokenizer-worker-num", "2"], "--tokenizer-worker-num"),
        (["--grpc-port", "9000"], "--grpc-port"),
    ],
)
def test_sglangs_server_flags_that_serve_replaces_are_refused_at_start(
    flags: list[str], named: str
) -> None:
    """In one line naming the flag, before a model loads: never taken and ignored."""
    command = [sys.executable, "-m", "trio_sglang", "serve", "--engine", "sglang"]
    done = subprocess.run(
        [*command, "--model-path", "m", *flags], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    [line] = [line for line in done.stderr.splitlines() if "not taken by trio-sglang" in line]
    assert line.startswith(named)


@pytest.mark.parametrize("command", ["serve", "dynamo-worker"])
def test_help_shows_both_groups(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_sglang", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    ours, _, theirs = text.partition("SGLang's server arguments (SGLang 0.5.23's own parser")
    assert theirs, text[-2000:]
    assert "--shutdown-grace" in ours
    for flag in ("--tp-size", "--mem-fraction-static", "--device", "--attention-backend"):
        assert f"\n  {flag} " in theirs, flag
    # A flag both have is listed once, with trio-sglang's.
    assert text.count("\n  --model-path ") == 1
    assert text.count("\n  --port ") == 1  # serve's own server; dynamo-worker has SGLang's

"""``trio-sglang`` as a newcomer meets it: its help, its one-line refusals, a closed pipe.

Every test runs the CLI as a subprocess (over loopback where it serves), each
bounded in time.
"""

from __future__ import annotations

import ast
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import trio

from _readme import ROOT

TIMEOUT = 30


async def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """``python -m trio_sglang ARGS`` to its end, its output captured, in ``TIMEOUT`` s."""
    with trio.fail_after(TIMEOUT):
        return await trio.run_process(
            [sys.executable, "-m", "trio_sglang", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


def help_entries(text: str) -> list[str]:
    """The option entries of an argparse help, each on one line: ``--port PORT help...``."""
    entries: list[str] = []
    _usage, _, body = text.partition("\n\n")
    for line in body.splitlines():
        if re.match(r"  -", line):
            entries.append(line.strip())
        elif line.startswith("    ") and entries:  # the help, wrapped under its option
            entries[-1] += " " + line.strip()
        elif not line.startswith("  "):  # a heading or a blank line ends an entry
            entries.append("")
    return [" ".join(entry.split()) for entry in entries if entry]


@pytest.mark.parametrize("command", ["serve", "demo", "bench-endpoint"])
async def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    result = await run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout.decode()
    entries = help_entries(text)
    usage = text.partition("\n\n")[0]
    assert {entry.split()[0].rstrip(",") for entry in entries} == set(
        re.findall(r"\[(-[\w-]+)", usage)
    ), entries  # every option of the usage, once
    for entry in entries:
        # `-h, --help`, `--port PORT` or `--engine {sim,sglang}`, then its help.
        invocation = re.match(r"(-\w, )?--[\w-]+( [A-Z_]+| \{\S+\})?", entry)
        assert invocation is not None, entry
        described = entry[invocation.end() :].strip()
        assert described, f"no help: {entry}"
        if invocation.group(2) is not None:  # takes a value: says what it is without one
            assert "(default: " in described, f"no default shown: {entry}"
    sim = [entry for entry in entries if entry.startswith("--sim-")]
    assert len(sim) == (9 if command == "serve" else 0)


async def test_a_port_in_use_is_one_line_on_stderr() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:  # listening: nobody else binds it
        port = taken.getsockname()[1]
        result = await run_cli("serve", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert result.stdout == b""
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"cannot listen on 127.0.0.1:{port}: "), lines
    assert "in use" in lines[0], lines


@pytest.mark.parametrize("command", ["serve", "bench-endpoint"])
async def test_help_never_shows_an_api_key_from_the_environment(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_SGLANG_API_KEY", "sk-not-for-your-eyes")
    result = await run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert b"sk-not-for-your-eyes" not in result.stdout


async def test_a_host_entry_that_is_no_host_is_one_line_on_stderr() -> None:
    result = await run_cli("serve", "--port", "0", "--allowed-bootstrap-hosts", "[::1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.decode().splitlines() == [
        "trio-sglang serve: allowed_bootstrap_hosts: '[::1' is not a host or host:port"
    ]


async def test_a_chat_template_on_the_sim_engine_is_one_line_on_stderr() -> None:
    """The SimEngine's template is its plain transcript: SGLang's --chat-template is not for it."""
    result = await run_cli("serve", "--port", "0", "--chat-template", "chatml")
    assert result.returncode == 2, result.stderr
    assert result.stderr.decode().splitlines() == ["--chat-template goes with --engine sglang"]


async def test_a_loop_on_the_sim_engine_is_one_line_on_stderr() -> None:
    """The SimEngine is trio alone: there is no asyncio code for trio to share the thread with."""
    result = await run_cli("serve", "--port", "0", "--loop", "guest")
    assert result.returncode == 2, result.stderr
    assert result.stderr.decode().splitlines() == [
        "--loop goes with --engine sglang: the SimEngine runs no asyncio code"
    ]


@pytest.mark.parametrize(
    ("hidden", "args", "message"),
    [
        ("hypercorn", [], "trio-sglang serve needs the serve extra: pip install"),
        (
            "sglang",
            ["--engine", "sglang", "--model-path", "some/model"],
            "--engine sglang needs SGLang: pip install 'trio-sglang[sglang]'",
        ),
    ],
)
async def test_a_missing_extra_is_one_line_on_stderr(
    hidden: str, args: list[str], message: str
) -> None:
    script = textwrap.dedent(
        f"""
        import sys

        sys.modules[{hidden!r}] = None  # as if not installed
        from trio_sglang._cli._main import main

        sys.exit(main(["serve", "--port", "0", *{args!r}]))
        """
    )
    with trio.fail_after(TIMEOUT):
        result = await trio.run_process(
            [sys.executable, "-c", script], capture_stdout=True, capture_stderr=True, check=False
        )
    assert result.returncode == 2, result.stderr
    assert result.stdout == b""
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(message), lines


async def test_a_reader_that_goes_away_ends_the_demo_quietly() -> None:
    """``trio-sglang demo | head -1``: no BrokenPipeError traceback, SIGPIPE's status."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_sglang", "demo", "--max-new-tokens", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    errors = bytearray()
    try:
        with trio.fail_after(TIMEOUT):
            read = bytearray()
            while b"\n" not in read:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the demo ended before its first line"
                read += chunk
            await proc.stdout.aclose()  # as `head -1` does; the demo goes on writing
            while chunk := await proc.stderr.receive_some():
                errors += chunk
            status = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert read.startswith(b"trio-sglang ")
    assert errors == b""
    assert status == 128 + 13  # as a shell reports a program SIGPIPE ended


def test_only_bench_calls_itself_the_main_job() -> None:
    """``nox -l`` shows each session's first docstring line; the README's main job is bench."""
    sessions = {
        node.name: ast.get_docstring(node) or ""
        for node in ast.parse((ROOT / "noxfile.py").read_text()).body
        if isinstance(node, ast.FunctionDef) and node.decorator_list
    }
    assert {"bench", "demo", "tests"} <= set(sessions)
    for name, doc in sessions.items():
        assert doc.strip(), f"nox -l shows no description for {name}"
        if name != "bench":
            assert "main job" not in doc.lower(), name
    assert sessions["demo"].splitlines()[0] == (
        "Stream, stop and kill three requests on the embedded SimEngine "
        "and show what reached the engine."
    )

"""A real SGLang ``TokenizerManager`` in this process, over the stand-in scheduler.

The harness's host process (``_host.py``) and the serving benchmark's SGLang
server (``benchmarks/_sglang_http.py``) start SGLang alike, so that what the
benchmark measures is the TokenizerManager the conformance tests check: one
copy of the start-up keeps the two from drifting apart. Call it in a process
of its own: SGLang's TokenizerManager kills its whole process tree when its
receive loop fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._peer import DisaggSetup
from ._tiny_model import build_tiny_model

__all__ = ["HostedTokenizerManager", "logged_since", "open_tokenizer_manager"]


@dataclass(frozen=True)
class HostedTokenizerManager:
    """What ``open_tokenizer_manager`` started; SGLang's own objects are untyped (``Any``)."""

    #: SGLang's ``TokenizerManager``; its ``server_args`` are the resolved ones.
    tokenizer_manager: Any
    #: SGLang's template manager, as ``init_tokenizer_manager`` returned it.
    templates: Any
    #: SGLang's ``PortArgs``: the IPC names the stand-in scheduler is bound to.
    port_args: Any
    #: The stand-in scheduler's JSON-lines log: what it received, and when.
    scheduler_log: Path


@contextmanager
def open_tokenizer_manager(
    workdir: Path,
    *,
    first_token_delay: float,
    token_interval: float,
    disagg: DisaggSetup | None = None,
    chat_template: str | None = None,
) -> Iterator[HostedTokenizerManager]:
    """The tiny model's TokenizerManager, with the stand-in scheduler as a child process.

    Yields once the scheduler has connected, since a request sent before is
    lost; stops the scheduler on the way out. ``workdir`` holds the tiny model
    and the scheduler's log. ``first_token_delay`` and ``token_interval`` (in
    seconds) pace the scheduler's tokens; ``disagg`` makes both a prefill or a
    decode server's; ``chat_template`` is SGLang's ``--chat-template``.
    """
    # The tiny model is built locally: a hub lookup would only wait and fail.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model = build_tiny_model(workdir / "tiny-llama")
    log = workdir / f"scheduler-{os.getpid()}.jsonl"
    log.write_bytes(b"")
    # Started first: it imports SGLang while this process builds the TokenizerManager,
    # and is told the sockets once they exist.
    scheduler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trio_sglang_harness._scheduler",
            "--first-token-delay",
            str(first_token_delay),
            "--token-interval",
            str(token_interval),
            "--log",
            str(log),
            *(() if disagg is None else ("--disagg", disagg.to_text())),
        ],
        stdin=subprocess.PIPE,
    )
    try:
        tm, templates, port_args = _tokenizer_manager(model, disagg, chat_template)
        if tm.bootstrap_server is not None:
            _wait_for_bootstrap_server(tm.server_args.disaggregation_bootstrap_port)
        _name_sockets(scheduler, port_args)
        _wait_until_ready(scheduler, log)
        yield HostedTokenizerManager(tm, templates, port_args, log)
    finally:
        scheduler.terminate()
        try:
            scheduler.wait(timeout=5)
        except subprocess.TimeoutExpired:
            scheduler.kill()


def _name_sockets(scheduler: subprocess.Popen[bytes], port_args: Any) -> None:
    """Tell the scheduler where to PULL from and PUSH to; if it has died, ``_wait_until_ready``
    says so."""
    sockets = {"input": port_args.scheduler_input_ipc_name, "output": port_args.tokenizer_ipc_name}
    assert scheduler.stdin is not None
    try:
        scheduler.stdin.write(json.dumps(sockets).encode() + b"\n")
        scheduler.stdin.close()
    except BrokenPipeError:
        pass


def _tokenizer_manager(
    model: Path, disagg: DisaggSetup | None, chat_template: str | None
) -> tuple[Any, Any, Any]:
    """A TokenizerManager built as ``sglang.Engine`` builds one, its templates and IPC names.

    Each step runs where the installed release has it: older releases lack
    ``resolve_once``, ``resolve_auto_parsers`` or ``runtime_context.publish``.
    """
    from sglang.srt.entrypoints import engine as sglang_engine
    from sglang.srt.server_args import PortArgs, ServerArgs

    # Only a prefill server starts the KV bootstrap server (on that port).
    role: dict[str, Any] = (
        {}
        if disagg is None
        else {"disaggregation_mode": disagg.role, "disaggregation_bootstrap_port": _free_port()}
    )
    server_args = ServerArgs(
        model_path=str(model),
        device="cpu",
        skip_tokenizer_init=False,
        incremental_streaming_output=True,
        log_level="warning",
        chat_template=chat_template,
        **role,
    )
    if hasattr(server_args, "resolve_once"):
        server_args.resolve_once()
    sglang_engine._set_envs_and_config(server_args)
    server_args.check_server_args()
    if hasattr(sglang_engine, "resolve_auto_parsers"):
        sglang_engine.resolve_auto_parsers(server_args)
    try:
        from sglang.srt.runtime_context import publish
    except ImportError:
        pass
    else:
        publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)
    tm, templates = sglang_engine.init_tokenizer_manager(server_args, port_args)
    return tm, templates, port_args


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for_bootstrap_server(port: int, timeout: float = 30) -> None:
    """Until a prefill TokenizerManager's KV bootstrap server answers ``/health``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the KV bootstrap server on port {port} did not start") from exc
            time.sleep(0.05)


def _wait_until_ready(scheduler: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    """Until the scheduler has connected (it logs "ready"): a request sent before is lost."""
    deadline = time.monotonic() + timeout
    while b'"ready"' not in log.read_bytes():
        if scheduler.poll() is not None:
            raise RuntimeError(f"the stand-in scheduler exited with {scheduler.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the stand-in scheduler did not start")
        time.sleep(0.05)


def logged_since(log: Path, offset: int) -> list[dict[str, Any]]:
    """The stand-in scheduler's events in ``log`` from byte ``offset`` on: its complete lines.

    The scheduler writes while this reads; a last line without its newline is
    still being written, and is left for the next read.
    """
    with log.open("rb") as f:
        f.seek(offset)
        written = f.read()
    complete = written[: written.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]

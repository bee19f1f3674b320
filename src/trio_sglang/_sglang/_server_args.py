"""SGLang's own server arguments on trio-sglang's command line (``--engine sglang``).

``serve`` and ``dynamo-worker`` take every flag of ``python -m
sglang.launch_server``, with SGLang's names, types, choices and help: they come
from SGLang's own parser (``ServerArgs.add_cli_args``), copied action by
action onto trio-sglang's, not from a list kept here. A flag both have
(``--context-length``, ``--max-running-requests``, ``--api-key``, ...) is
parsed once, as trio-sglang's, and does both jobs: the engine gets its value
too, and trio-sglang's edge limit follows it. ``--host`` and ``--port`` stay
trio-sglang's alone: they place its HTTP server, and the engine runs none.

Importing SGLang's parser imports SGLang (and torch: seconds), so the CLI does
it only when ``--engine sglang`` is asked for, or for ``--help`` where SGLang
is installed. SGLang decides at import whether it runs on a CPU, so
``--device cpu`` is read off the command line before that import.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._cpu import prepare_cpu_engine

__all__ = [
    "SERVER_FLAGS_REFUSED",
    "SGLangOptions",
    "add_sglang_options",
    "refused_flag",
    "sglang_installed",
    "wants_sglang",
]

#: Flags both have that stay trio-sglang's: where its own HTTP server listens.
_OURS_ONLY = frozenset({"host", "port"})

#: SGLang's flags for the parts of its server that ``serve`` replaces (the
#: listening socket, its TLS and HTTP/2, the API-key middleware, the processes
#: around its HTTP app), and why each is refused rather than taken and ignored.
_TLS = "serve speaks plain HTTP: put TLS in a proxy in front of it"
_GRPC = "SGLang's gRPC server would reach the engine around trio-sglang's lifecycle"
SERVER_FLAGS_REFUSED: dict[str, str] = {
    "admin_api_key": "serve's --api-key guards every route; it has no admin key",
    **dict.fromkeys(("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_keyfile_password"), _TLS),
    "enable_ssl_refresh": _TLS,
    "enable_http2": "serve's own --http2 speaks HTTP/2 (cleartext, prior knowledge)",
    "tokenizer_worker_num": "serve runs SGLang's server with one tokenizer, in its own process",
    "fastapi_root_path": "serve mounts SGLang's routes at the root",
    **dict.fromkeys(("grpc_port", "grpc_mode", "smg_grpc_mode"), _GRPC),
    "sidecar": "SGLang's sidecar goes with its gRPC server, which serve does not run",
}


def refused_flag(server_args: dict[str, Any]) -> str | None:
    """The first given flag ``serve`` refuses, in one line with why; ``None`` if none is."""
    for dest, why in SERVER_FLAGS_REFUSED.items():
        if dest in server_args:
            return f"--{dest.replace('_', '-')} is not taken by trio-sglang serve: {why}"
    return None


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _option_value(argv: Sequence[str], option: str) -> str | None:
    """The last value given to ``option`` in ``argv`` (``--opt value`` or ``--opt=value``)."""
    found = None
    for i, token in enumerate(argv):
        if token == option and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith(option + "="):
            found = token.partition("=")[2]
    return found


def wants_sglang(argv: Sequence[str]) -> bool:
    """Whether the command line asks for the real engine (``--engine sglang``)."""
    return _option_value(argv, "--engine") == "sglang"


@dataclass(frozen=True)
class SGLangOptions:
    """SGLang's parser's actions as they sit on one of trio-sglang's parsers."""

    #: SGLang's actions, added as they are (their dests are SGLang's field names).
    own: tuple[argparse.Action, ...]
    #: (trio-sglang's action, SGLang's action) for every flag both have.
    shared: tuple[tuple[argparse.Action, argparse.Action], ...]

    def server_args(self, args: argparse.Namespace) -> dict[str, Any]:
        """The SGLang server arguments the command line gave (SGLang's defaults elsewhere).

        A value that equals its flag's default counts as not given, so that
        what the engine is told is what the user said, and what a device's
        defaults (``--device cpu``) may fill in is everything else.
        """
        given: dict[str, Any] = {}
        for action in self.own:
            value = getattr(args, action.dest, action.default)
            if value != action.default:
                given[action.dest] = value
        for ours, theirs in self.shared:
            value = getattr(args, ours.dest, ours.default)
            if theirs.dest in _OURS_ONLY or value == ours.default or value is None:
                continue
            if isinstance(value, list) and theirs.nargs is None:
                value = value[0]  # repeatable here (aliases), one value in SGLang
            given[theirs.dest] = value
        return given


@functools.cache
def _sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def add_sglang_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> SGLangOptions:
    """Put SGLang's server arguments on ``parser`` as a group of their own.

    Call it after every trio-sglang option is on ``parser``: a flag already
    there is trio-sglang's, and SGLang's copy of it is left out (see
    ``SGLangOptions.shared``). ``argv`` is the command line, read for
    ``--device cpu`` before SGLang is imported.
    """
    if _option_value(argv, "--device") == "cpu":
        prepare_cpu_engine()
    from sglang.version import __version__

    theirs = _sglang_parser()
    group = parser.add_argument_group(
        f"SGLang's server arguments (SGLang {__version__}'s own parser; with --engine "
        "sglang). Those trio-sglang has too are listed above and do both jobs: the engine "
        "gets them and trio-sglang's limits follow; --host and --port are trio-sglang's alone"
    )
    ours = parser._option_string_actions
    own: list[argparse.Action] = []
    shared: list[tuple[argparse.Action, argparse.Action]] = []
    for action in theirs._actions:
        if not action.option_strings:
            continue
        taken = [ours[option] for option in action.option_strings if option in ours]
        if taken:
            shared.append((taken[0], action))
        else:
            group._add_action(action)
            own.append(action)
    return SGLangOptions(tuple(own), tuple(shared))

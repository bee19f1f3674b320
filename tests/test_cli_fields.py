"""The CLI's options that mirror ``ServerLimits``, ``AbortPolicy`` and ``SimDisaggTiming``.

They are made from the fields, so a field added to one of these records
must come out as an option (or be kept off the command line on purpose),
with the field's default and its ``#:`` doc as the help.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from trio_sglang._cli import _parser as _cli
from trio_sglang._cli._field_options import FieldOptions, field_docs
from trio_sglang._core._policy import AbortPolicy
from trio_sglang._limits import API_KEY_ENV, ServerLimits
from trio_sglang.sim import SimDisaggTiming

MIRRORS: dict[str, FieldOptions[Any]] = {
    "limits": _cli._LIMITS,
    "policy": _cli._POLICY,
    "sim-disagg": _cli._SIM_DISAGG,
}
#: Which commands take each record's options.
COMMANDS = {"limits": ["serve"], "policy": ["serve", "dynamo-worker"]}
COMMANDS["sim-disagg"] = COMMANDS["policy"]
#: A value unlike every default, by the field's annotation.
VALUES: dict[str, tuple[list[str], Any]] = {
    "int": (["7"], 7),
    "int | None": (["7"], 7),
    "float": (["0.5"], 0.5),
    "bool": ([], True),
    "tuple[str, ...]": (["a", "b:1"], ("a", "b:1")),
}


def command_parser(command: str) -> argparse.ArgumentParser:
    for action in _cli.build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices[command]
            return parser
    raise AssertionError("no subcommands")


@pytest.mark.parametrize(
    ("name", "command"), [(name, c) for name, commands in COMMANDS.items() for c in commands]
)
def test_every_field_is_an_option_with_its_default_and_its_doc(name: str, command: str) -> None:
    mirror = MIRRORS[name]
    names = {field.name for field in dataclasses.fields(mirror.record)}
    assert set(mirror.kept) <= names, "kept names no field"
    actions = {action.dest: action for action in command_parser(command)._actions}
    docs = field_docs(mirror.record)
    for field in dataclasses.fields(mirror.record):
        if field.name in mirror.kept:
            continue
        action = actions.get(mirror.prefix + field.name)
        assert action is not None, f"{command} has no option for {field.name}"
        assert action.option_strings == [mirror.flag(field.name)]
        if field.default == ():  # the option has none; given none, the field keeps its own
            assert action.default is None, field.name
        else:
            assert action.default == field.default, field.name
        assert docs.get(field.name), f"{field.name} has no #: doc for its help"
        assert action.help, field.name


def test_a_bare_command_line_builds_each_record_as_its_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = _cli.build_parser().parse_args(["serve"])
    assert _cli.server_limits(args) == ServerLimits()
    assert _cli._POLICY.build(args) == AbortPolicy()
    assert _cli.engine_options(args).sim_args["disagg_timing"] == SimDisaggTiming()


def test_every_option_reaches_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    argv, expected = ["serve"], {}
    for name, mirror in MIRRORS.items():
        wanted: dict[str, Any] = {}
        for field in dataclasses.fields(mirror.record):
            if field.name not in mirror.kept:
                words, wanted[field.name] = VALUES[str(field.type)]
                argv += [mirror.flag(field.name), *words]
        expected[name] = wanted
    args = _cli.build_parser().parse_args(argv)
    built = {
        "limits": _cli.server_limits(args),
        "policy": _cli._POLICY.build(args),
        "sim-disagg": _cli.engine_options(args).sim_args["disagg_timing"],
    }
    for name, record in built.items():
        assert {key: getattr(record, key) for key in expected[name]} == expected[name], name
    assert built["limits"].api_key == "from-the-environment"  # the one written out


def test_the_help_names_a_field_by_its_option() -> None:
    """A ``#:`` doc's ``field`` is the option a command-line user knows it by."""
    actions = {action.dest: action for action in command_parser("serve")._actions}
    assert "per --sse-heartbeat " in str(actions["max_sse_heartbeats_per_second"].help)
    assert "``" not in str(actions["http2"].help)

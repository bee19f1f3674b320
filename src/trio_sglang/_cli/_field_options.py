"""Command-line options that mirror a dataclass's fields, made from the fields.

A bound's name, type, default and meaning are said once, by its field and
the field's ``#:`` comment; an option written out beside it by hand drifted
from it. The CLI builds every parser at each start, so the comments are read
with a scan of the class's source lines (a fraction of a millisecond), not a
parse of its module.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import linecache
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["FieldOptions", "port_number", "positive_int", "seconds"]

Record = TypeVar("Record", bound="DataclassInstance")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


#: How an option takes its field's value, by the field's annotation: every
#: count on the command line is at least 1, every duration is in seconds.
#: A tuple's option has no default of its own: given none, the field keeps its.
_KINDS: dict[str, dict[str, Any]] = {
    "int": {"type": positive_int},
    "int | None": {"type": positive_int},
    "float": {"type": seconds},
    "bool": {"action": "store_true"},
    "tuple[str, ...]": {"nargs": "+", "default": None},
}

_CODE = re.compile(r"``([^`]+)``")


@dataclass(frozen=True, slots=True)
class FieldOptions(Generic[Record]):
    """The fields of ``record`` that are options, ``--{prefix}{field-name}``; ``kept`` are not.

    Every field is one or the other, so that a field added to ``record``
    fails the CLI's tests until it is given an option or a reason to be kept.
    """

    record: type[Record]
    prefix: str = ""
    #: Fields the command line does not set: they keep their defaults, or what
    #: ``build`` is given for them.
    kept: tuple[str, ...] = ()
    #: An option's metavar where its dest's upper case would not do.
    metavars: Mapping[str, str] = field(default_factory=dict)

    def flag(self, name: str) -> str:
        return "--" + (self.prefix + name).replace("_", "-")

    def add(
        self,
        group: argparse._ActionsContainer,
        *names: str,
        helps: Mapping[str, str] | None = None,
    ) -> None:
        """The options of ``names``, in that order; ``helps`` where a command says more."""
        fields = {f.name: f for f in dataclasses.fields(self.record)}
        for name in names:
            options = {"default": fields[name].default, **_KINDS[str(fields[name].type)]}
            if name in self.metavars:
                options["metavar"] = self.metavars[name]
            group.add_argument(
                self.flag(name),
                help=(helps or {}).get(name) or self._help(field_docs(self.record).get(name, "")),
                **options,
            )

    def build(self, args: argparse.Namespace, **given: Any) -> Record:
        """``record`` from the options in ``args``, and ``given`` for the kept fields."""
        values = dict(given)
        for f in dataclasses.fields(self.record):
            value = None if f.name in self.kept else getattr(args, self.prefix + f.name)
            if value is not None:  # else the option's default is the field's, or none
                values[f.name] = tuple(value) if isinstance(value, list) else value
        return self.record(**values)

    def _help(self, doc: str) -> str:
        """A ``#:`` doc as the help says it: lower-case, its fields by their options."""
        options = {f.name for f in dataclasses.fields(self.record)} - set(self.kept)
        text = _CODE.sub(lambda code: self.flag(code[1]) if code[1] in options else code[1], doc)
        if not text[1:2].isupper():  # an acronym (SSE) stays as it is
            text = text[:1].lower() + text[1:]
        return text.removesuffix(".").replace("%", "%%")


@functools.cache
def field_docs(record: type[DataclassInstance]) -> dict[str, str]:
    """Each field's ``#:`` comment, the lines above it, joined; none without the source."""
    fields = {f.name for f in dataclasses.fields(record)}
    source = inspect.getsourcefile(record)
    header = re.compile(rf"class {record.__name__}\b")
    docs: dict[str, str] = {}
    comment: list[str] = []
    inside = False
    for line in linecache.getlines(source) if source else []:
        text = line.strip()
        if not inside:
            inside = header.match(line) is not None
        elif text and not line[0].isspace():  # the next top-level statement
            break
        elif text.startswith("#:"):
            comment.append(text[2:].strip())
        else:
            name = text.partition(":")[0]
            if comment and name in fields:
                docs[name] = " ".join(comment)
            comment = []
    return docs

"""SGLang's own HTTP test kits (``sglang.test.kits``), run against one server URL.

    python tests/_sglang_kits.py URL MODEL OUT.json [--times N] [CASE ...]

SGLang tests its server with these mixins, each a set of ``unittest`` cases
that talk to ``self.base_url`` over HTTP. They are run here unchanged, each
mixed into a ``TestCase`` as SGLang's own test files mix them, and each
case's outcomes are written to ``OUT.json``, a list per case (``passed``,
``skipped``, or ``failed: <the last line of its traceback>``): all cases
once, or the named ones (``RegexConstrainedMixinCase.test_regex_generate_json``)
``--times`` times, for a case that samples. In a process of its own:
the kits print, and some call ``requests`` for minutes. The kits that need
what the tiny model cannot give (a reasoning model, LoRA, sessions, a
multimodal model, speculative decoding) are not in ``KITS``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import sys
import unittest
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

__all__ = ["KITS", "main"]

#: The kits run: module of ``sglang.test.kits``, mixin class.
KITS = (
    ("basic_api_contract_kit", "BasicAPIContractMixin"),
    ("matched_stop_kit", "MatchedStopMixin"),
    ("json_constrained_kit", "JSONConstrainedMixin"),
    ("regex_constrained_kit", "RegexConstrainedMixin"),
    ("ebnf_constrained_kit", "EBNFConstrainedMixin"),
    ("json_mode_kit", "JSONModeMixin"),
    ("abort_timeout_kit", "AbortAllMixin"),
)


class _Alive:
    """The kits check ``self.process.poll()`` (the server they started); the caller owns it."""

    def poll(self) -> None:
        return None


def _cases(url: str, model: str) -> Iterator[type[unittest.TestCase]]:
    import openai

    for module, mixin in KITS:
        kit = getattr(importlib.import_module(f"sglang.test.kits.{module}"), mixin)
        attributes: dict[str, Any] = {
            "base_url": url,
            "model": model,
            "api_key": "unused",
            "process": _Alive(),
            "client": openai.Client(api_key="unused", base_url=f"{url}/v1"),
            # Fewer and shorter than SGLang's GPU defaults: this is a CPU.
            "abort_all_num_requests": 8,
            "abort_all_max_new_tokens": 4000,
        }
        yield type(f"{mixin}Case", (kit, unittest.TestCase), attributes)


def run(url: str, model: str, only: Collection[str] = (), times: int = 1) -> dict[str, list[str]]:
    """Each case's outcomes, ``times`` runs: every case, or the ones named in ``only``."""
    outcomes: dict[str, list[str]] = {}
    for case in _cases(url, model):
        suite = unittest.TestLoader().loadTestsFromTestCase(case)
        tests = [test for test in suite if not only or _name(test) in only]
        for _ in range(times if tests else 0):
            result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(
                unittest.TestSuite(tests)
            )
            failed = {
                _name(test): trace.strip().splitlines()[-1][:300]
                for test, trace in result.failures + result.errors
            }
            skipped = {_name(test) for test, _ in result.skipped}
            for name in map(_name, tests):
                if name in failed:
                    outcome = f"failed: {failed[name]}"
                else:
                    outcome = "skipped" if name in skipped else "passed"
                outcomes.setdefault(name, []).append(outcome)
    return outcomes


def _name(test: unittest.TestCase) -> str:
    return test.id().split(".", 1)[1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="_sglang_kits.py", description=__doc__)
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="*", help="only these cases (all by default)")
    parser.add_argument("--times", type=int, default=1, help="runs of each case")
    args = parser.parse_args(argv)
    outcomes = run(args.url, args.model, args.cases, args.times)
    if missing := set(args.cases) - outcomes.keys():
        parser.error(f"no such case: {sorted(missing)}")
    args.out.write_text(json.dumps(outcomes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

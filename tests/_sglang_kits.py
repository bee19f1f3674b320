"""SGLang's own HTTP test kits (``sglang.test.kits``), run against one server URL.

    python tests/_sglang_kits.py URL MODEL OUT.json

SGLang tests its server with these mixins, each a set of ``unittest`` cases
that talk to ``self.base_url`` over HTTP. They are run here unchanged, each
mixed into a ``TestCase`` as SGLang's own test files mix them, and each
case's outcome is written to ``OUT.json`` (``passed``, ``skipped``, or
``failed: <the last line of its traceback>``). In a process of its own:
the kits print, and some call ``requests`` for minutes. The kits that need
what the tiny model cannot give (a reasoning model, LoRA, sessions, a
multimodal model, speculative decoding) are not in ``KITS``.
"""

from __future__ import annotations

import importlib
import io
import json
import sys
import unittest
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


def run(url: str, model: str) -> dict[str, str]:
    import openai

    outcomes: dict[str, str] = {}
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
        case = type(f"{mixin}Case", (kit, unittest.TestCase), attributes)
        suite = unittest.TestLoader().loadTestsFromTestCase(case)
        names = [test.id().split(".", 1)[1] for test in suite]
        result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
        failed = {
            test.id().split(".", 1)[1]: trace.strip().splitlines()[-1][:300]
            for test, trace in result.failures + result.errors
        }
        skipped = {test.id().split(".", 1)[1] for test, _ in result.skipped}
        for name in names:
            if name in failed:
                outcomes[name] = f"failed: {failed[name]}"
            else:
                outcomes[name] = "skipped" if name in skipped else "passed"
    return outcomes


def main(argv: list[str]) -> int:
    url, model, out = argv
    Path(out).write_text(json.dumps(run(url, model), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

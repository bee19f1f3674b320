"""``trio-sglang bench-endpoint``'s options, importable without the bench extra.

The CLI builds every subcommand's parser at start, including this one's on
a machine without httpx or matplotlib, so this module imports neither; the
command itself (``_command``) does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import get_args

from .._limits import API_KEY_ENV
from ._apis import Api
from ._departures import MEANING
from ._servers import KINDS

__all__ = ["add_options"]


def add_options(
    parser: argparse.ArgumentParser,
    *,
    count: Callable[[str], int],
    seconds: Callable[[str], float],
) -> None:
    """Every option, with its help and its default. ``count`` and ``seconds`` are the CLI's own
    checks, so every subcommand refuses a bad number in the same words."""
    target = parser.add_argument_group("the endpoint")
    target.add_argument(
        "--url",
        help="the server's base URL, as http://host:port (default: none; needed unless --compare)",
    )
    target.add_argument(
        "--api",
        choices=list(get_args(Api)),
        default="openai-chat",
        help="which route and body: /v1/chat/completions, /v1/completions, or SGLang's /generate",
    )
    target.add_argument(
        "--model",
        help="the model to ask for (default: the first /v1/models lists; none on /generate)",
    )
    target.add_argument(
        "--api-key",
        help=f"sent as 'Authorization: Bearer KEY' on every request and scrape (default: "
        f"${API_KEY_ENV} if set, else none)",
    )
    target.add_argument(
        "--metrics-url",
        action="append",
        metavar="URL",
        help="a Prometheus page of the server's own metrics; repeat it for several workers, "
        "whose gauges add up (default: URL/metrics)",
    )
    target.add_argument(
        "--metrics",
        help=f"which gauges and counter to read: a server kind ({', '.join(KINDS)}), or "
        "in_flight=NAME[+NAME...][,tokens=NAME], each NAME a metric or a selector such as "
        "'name{label=\"value\"}' (default: recognised from the page)",
    )
    load = parser.add_argument_group("the clients")
    load.add_argument(
        "--phases",
        nargs="+",
        metavar="PHASE",
        help="phases to run, in order: "
        + "; ".join(f"{name}: {meaning}" for name, meaning in MEANING.items())
        + ". Each but stay is run with a clean close and with a reset (SO_LINGER 0); "
        "WHEN:close or WHEN:reset runs one (default: every phase)",
    )
    load.add_argument(
        "--concurrency", type=count, default=8, help="clients at once: each wave's size"
    )
    load.add_argument("--requests", type=count, default=32, help="requests per phase")
    load.add_argument("--max-tokens", type=count, default=64, help="tokens each request asks for")
    load.add_argument(
        "--prompt-words",
        type=count,
        default=16,
        help="words in each prompt (after a number that keeps prompts apart in a prefix cache)",
    )
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask every request to run to --max-tokens (SGLang's and vLLM's ignore_eos)",
    )
    load.add_argument(
        "--leave-delay",
        type=seconds,
        help="before_first_token: seconds from sending to leaving (default: half the warm-up's "
        "median time to first token)",
    )
    load.add_argument(
        "--mid-stream-chunks",
        type=count,
        default=8,
        help="mid_stream: token events read before leaving (below --max-tokens)",
    )
    load.add_argument(
        "--request-timeout",
        type=seconds,
        default=60.0,
        help="a request not ended after this counts as failed",
    )
    measure = parser.add_argument_group("measuring")
    measure.add_argument(
        "--sample-interval",
        type=seconds,
        default=0.01,
        help="seconds between two scrapes of the metrics: the resolution of every release time",
    )
    measure.add_argument(
        "--settle",
        type=seconds,
        default=3.0,
        help="after each wave, the most to wait for the gauges to come back; where they change "
        "only as the engine steps (SGLang, vLLM, named ones), then a probe request and as "
        "long again; what is still held then is leaked",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write every figure here (default: none)")
    out.add_argument("--plot", metavar="PATH", help="write the PNG here (default: none)")
    out.add_argument(
        "--compare",
        nargs="+",
        metavar="JSON",
        help="print saved runs (--json files) side by side, and run nothing (default: none)",
    )

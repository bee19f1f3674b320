"""``trio-sglang dynamo-worker``'s own options, importable without the dynamo extra.

The CLI builds every subcommand's parser at start, on machines without
Dynamo too, so this module imports nothing of Dynamo's; the options the
worker shares with ``serve`` (the engine, the loop, the shutdown, the
SimEngine) are the CLI's.
"""

from __future__ import annotations

import argparse

from ._config import MODEL_INPUTS

__all__ = ["add_options"]


def add_options(worker: argparse.ArgumentParser) -> None:
    """Where the worker registers, what its frontend sends, and its metrics port."""
    worker.add_argument("--model-name", required=True, help="the model's name at Dynamo's frontend")
    worker.add_argument("--namespace", default="dynamo", help="the endpoint's Dynamo namespace")
    worker.add_argument("--component", default="backend", help="the endpoint's component")
    worker.add_argument("--endpoint", default="generate", help="the endpoint's name")
    worker.add_argument(
        "--model-input",
        choices=MODEL_INPUTS,
        default="tokens",
        help="what the frontend sends: tokens (Dynamo's ModelInput.Tokens: the frontend "
        "tokenizes with the model's tokenizer and chat template, and its KV router works) or "
        "text (ModelInput.Text: the worker gets the client's OpenAI request, renders chat with "
        "the engine's own template and tokenizes; no tokenizer at the frontend)",
    )
    worker.add_argument(
        "--model-path",
        help="the model's folder: with --model-input tokens the frontend tokenizes with its "
        "tokenizer and chat template (default: the SimEngine's own tiny tokenizer; --engine "
        "sglang needs one)",
    )
    worker.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the --metrics-port server"
    )
    worker.add_argument(
        "--metrics-port",
        type=int,
        help="serve GET /metrics (the trio_sglang_* metrics of serve) on this port; 0 picks "
        "a free one (default: none)",
    )

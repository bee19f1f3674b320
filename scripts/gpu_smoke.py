"""Smoke test of ``SGLangEngine`` on a real ``sglang.Engine``, on a GPU or on the CPU.

Streams one request, then cancels one in each phase, and prints what the
caller saw and what the engine still held afterwards: the tokenizer side's
registry and the scheduler's own load. Exits 1 if either held anything. On a
machine with a GPU and the sglang extra installed:

    python scripts/gpu_smoke.py --model-path Qwen/Qwen2.5-0.5B-Instruct

On any CPU (CI runs it so, on the tiny model ``nox -s real-engine`` builds):

    python scripts/gpu_smoke.py --model-path DIR --device cpu
"""

from __future__ import annotations

import argparse
import json
import time

import trio

import trio_sglang as ts
from trio_sglang_harness._host import _slow_tokenizer
from trio_sglang_harness._scenarios import CancelPhase, RidRecorder, Scenario, run_scenario

PHASES: list[CancelPhase | None] = [
    None,
    "before_registration",
    "tokenizing",
    "dispatched",
    "mid_stream",
    "after_finish",
]


async def main(model_path: str, max_new_tokens: int, device: str | None) -> int:
    on = {} if device is None else {"device": device}
    engine = ts.SGLangEngine(model_path=model_path, incremental_streaming_output=True, **on)
    recorder = RidRecorder(engine)
    request = {
        "text": "Tell me about structured concurrency.",
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    leaks = 0
    async with ts.open_worker(recorder) as worker:
        print(json.dumps(worker.capabilities(), indent=2))
        tm = engine.tokenizer_manager
        original = tm._tokenize_one_request
        for phase in PHASES:
            # A slowed tokenizer gives the "tokenizing" cancel something to land in.
            _slow_tokenizer(tm, original, 0.5 if phase == "tokenizing" else 0.0)
            scenario = Scenario(str(phase), request, "text", phase)
            started = time.monotonic()
            with trio.fail_after(120):
                seen = await run_scenario(worker, recorder, scenario, list, settle=0.5)
            held, scheduled = len(tm.rid_to_state), engine.scheduler_requests()
            leaks += held + scheduled
            print(
                f"{phase!s:20} chunks={seen.chunks:4} last={seen.finish_reasons[-1:]} "
                f"ids={sorted(set(seen.ids_seen))} engine_holds={held} "
                f"scheduler_holds={scheduled} in {time.monotonic() - started:.2f}s"
            )
    print("leaked:", leaks)
    return 1 if leaks else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", help="SGLang's --device (default: SGLang's, a GPU)")
    args = parser.parse_args()
    raise SystemExit(trio.run(main, args.model_path, args.max_new_tokens, args.device))

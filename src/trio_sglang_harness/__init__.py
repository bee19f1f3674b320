"""A GPU-free SGLang harness: the real TokenizerManager against a stand-in scheduler.

Development support, not part of trio-sglang's wheel: the conformance tests,
``nox -s real-engine`` and the benchmarks import it from the source tree,
which the editable install every nox session makes puts on the path. Needs the
``sglang`` extra (SGLang's CPU-importable parts). The real TokenizerManager
runs in its own process (it kills its process tree on errors), beside a
stand-in scheduler process that speaks SGLang's ZMQ protocol with SGLang's own
message classes, and a tiny model built locally with no hub access.
``open_sglang_harness`` starts and stops all of it; the same ``Scenario`` runs
on the SimEngine with ``observe_on_sim``, so the two can be compared. A
``DisaggSetup`` runs both as a prefill or a decode server's, with a fixed peer
script playing the other side of each room. ``SGLangHarness.chat`` sends one
chat body through trio-sglang's chat route and through SGLang's own, and gives
back what each fed the scheduler. With ``dynamo=True`` a scenario can also run
through NVIDIA Dynamo 1.6.1's own SGLang handler on the same TokenizerManager
(``caller="dynamo-1.6"``), and ``observe_caller`` runs a scenario through any
caller's ``CallerStream``. With ``real_engine=True`` there is no stand-in: the
host runs the whole ``sglang.Engine`` on the CPU
(``SGLangEngine(device="cpu")``), sees its real scheduler through a tap on the
TokenizerManager's sockets (``_tap.py``), and reports what the scheduler still
held by its own load snapshot. ``open_tokenizer_manager`` is the harness's
start-up on its own (the TokenizerManager and the stand-in scheduler, in the
calling process), for a process that serves SGLang some other way: the serving
benchmark runs SGLang's own HTTP server on it.
"""

from ._chat import ChatPrompts
from ._harness import Caller, SGLangHarness, open_sglang_harness
from ._peer import DisaggSetup
from ._scenarios import (
    CallerStream,
    CancelPhase,
    Observation,
    Scenario,
    observe_caller,
    observe_on_sim,
    sim_scheduler_events,
)
from ._tiny_model import build_tiny_model
from ._tokenizer_manager import HostedTokenizerManager, logged_since, open_tokenizer_manager

__all__ = [
    "Caller",
    "CallerStream",
    "CancelPhase",
    "ChatPrompts",
    "DisaggSetup",
    "HostedTokenizerManager",
    "Observation",
    "SGLangHarness",
    "Scenario",
    "build_tiny_model",
    "logged_since",
    "observe_caller",
    "observe_on_sim",
    "open_sglang_harness",
    "open_tokenizer_manager",
    "sim_scheduler_events",
]

"""A GPU-free SGLang harness: the real TokenizerManager against a stand-in scheduler.

Needs the ``sglang`` extra (SGLang's CPU-importable parts). The real
TokenizerManager runs in its own process (it kills its process tree on
errors), beside a stand-in scheduler process that speaks SGLang's ZMQ
protocol with SGLang's own message classes, and a tiny model built locally
with no hub access. ``open_sglang_harness`` starts and stops all of it; the
same ``Scenario`` runs on the SimEngine with ``observe_on_sim``, so the two
can be compared. A ``DisaggSetup`` runs both as a prefill or a decode
server's, with a fixed peer script playing the other side of each room.
``SGLangHarness.chat`` sends one chat body through trio-sglang's chat route
and through SGLang's own, and gives back what each fed the scheduler.
"""

from ._chat import ChatPrompts
from ._harness import SGLangHarness, open_sglang_harness
from ._peer import DisaggSetup
from ._scenarios import CancelPhase, Observation, Scenario, observe_on_sim
from ._tiny_model import build_tiny_model

__all__ = [
    "CancelPhase",
    "ChatPrompts",
    "DisaggSetup",
    "Observation",
    "SGLangHarness",
    "Scenario",
    "build_tiny_model",
    "observe_on_sim",
    "open_sglang_harness",
]

"""The single controller: a rollout pump and a train pump running GRPO side by side.

The package face: ``SingleController`` (the wiring, ``controller.py``), its error, its
hooks, and the drop policy's pure decisions. The module docstring of ``controller.py`` maps
the parts and what each owns. The storage names are re-exported from
``rolloutrun_runtime.contract.layout`` (their one spelling) for the modules that reached
them through this package.
"""

from rolloutrun_runtime.algorithms.single_controller.controller import SingleController
from rolloutrun_runtime.algorithms.single_controller.drop_policy import (
    REPLACEMENTS_PER_PROMPT,
    DropAction,
    decide_drop,
    decide_slot_drop,
    shortfall_slots,
)
from rolloutrun_runtime.algorithms.single_controller.hooks import NoHooks, OnStep, RunHooks
from rolloutrun_runtime.algorithms.single_controller.run_state import ControllerError, RunState
from rolloutrun_runtime.contract.layout import DATA_PLANE_PREFIX, LEDGER_FILE, RUNTIME_STATE_FILE

__all__ = [
    "DATA_PLANE_PREFIX",
    "LEDGER_FILE",
    "REPLACEMENTS_PER_PROMPT",
    "RUNTIME_STATE_FILE",
    "ControllerError",
    "DropAction",
    "NoHooks",
    "OnStep",
    "RunHooks",
    "RunState",
    "SingleController",
    "decide_drop",
    "decide_slot_drop",
    "shortfall_slots",
]

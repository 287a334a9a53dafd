"""Serializing a capture into the files both checkpoint kinds hold.

Why its own module: this is the work taken off the snapshot pump's loop (the cut only
captures; see :mod:`.snapshots`), run in a thread for snapshots and inline for trainer
checkpoints. It checks the capture's inventory first, so an incomplete capture fails here,
before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.inventory import (
    compare_rows,
    require_complete,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots_decisions import (
    encode_captured_ledger,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import CapturedRolloutState
from rolloutrun_runtime.contract.layout import (
    CONTROLLER_STATE_FILE,
    DATA_PLANE_PREFIX,
    ENVIRONMENT_FILE,
    JOURNAL_FILE,
    LEDGER_FILE,
    RUNTIME_STATE_FILE,
)
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.data_plane import DataPlane

#: How a capture's data plane becomes files: by default whole (``rows.npz``); a snapshot's
#: segment writer writes only what changed (:mod:`.data_segments`).
DataPlaneFiles = Callable[[DataPlane, Mapping[str, Any]], Mapping[str, bytes]]


def write_controller_sidecars(
    captured: CapturedRolloutState, data_plane_files: DataPlaneFiles | None = None
) -> dict[str, bytes]:
    """Serialize a capture: the files both checkpoint kinds hold (runs off the loop)."""
    files: dict[str, bytes] = {}
    # The inventory of the cut's copies, off the loop (an incomplete capture fails here).
    inventory = compare_rows(
        captured.data_plane,
        replay_view=captured.replay_view,
        retained_row_keys=captured.retained_row_keys,
        staging_refs=captured.staging_refs,
    )
    require_complete(inventory, f"{captured.kind.value} at step {captured.train_step}")
    # per-group JSON only in locals (not on ``captured``): gone when this call returns
    replay_json = [group.to_json() for group in captured.replay_view]
    if captured.ledger_capture is not None:
        sidecar = encode_captured_ledger(captured)
        files[LEDGER_FILE] = sidecar.data
        captured.controller_state["rollout_recovery"] = sidecar.metadata()
        captured.data_plane_metadata.update(sidecar.metadata())
    dp_metadata = {**captured.data_plane_metadata, "replay": replay_json}
    pack = data_plane_files or DataPlane.to_files
    for name, data in pack(captured.data_plane, dp_metadata).items():
        files[DATA_PLANE_PREFIX + name] = data
    crash_point("after_data_plane_save")
    controller_state = {**captured.controller_state, "replay": replay_json}
    files[CONTROLLER_STATE_FILE] = json.dumps(controller_state, sort_keys=True).encode()
    results = [r.to_json() for r in captured.finalizer_results]
    runtime_state = {**captured.runtime_state, "finalizer_results": results}
    files[RUNTIME_STATE_FILE] = json.dumps(runtime_state, sort_keys=True).encode()
    files[JOURNAL_FILE] = json.dumps(captured.journal, sort_keys=True).encode()
    if captured.environment_snapshot is not None:
        files[ENVIRONMENT_FILE] = captured.environment_snapshot.to_bytes()
    return files

"""Serializing a capture into the files both checkpoint kinds hold.

Why its own module: this is the work taken off the snapshot pump's loop (the cut only
captures; see :mod:`.snapshots`), run in a thread for snapshots and inline for trainer
checkpoints. It checks the capture's inventory first, so an incomplete capture fails here,
before anything is written.

A snapshot's writer keeps :class:`SidecarFragments`: the JSON of each replay group, each
finalizer result and each training-journal entry, encoded once. They are the same objects
from one snapshot to the next (a replay group and a journal entry are frozen, a finalizer
result made once and never changed), so a snapshot encodes only the new ones and joins the
rest; the files are byte for byte what encoding the whole documents gives. (The journal
holds every step trained since step 1: encoded whole, twice, at each snapshot, its cost grew
with the run's length.)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import SegmentWriter
from rolloutrun_runtime.algorithms.rollout_checkpointing.inventory import (
    compare_rows,
    require_complete,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots_decisions import (
    encode_captured_ledger,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    TRAINING_JOURNAL_SCHEMA,
    CapturedRolloutState,
    TrainedStep,
    journal_entry_json,
)
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


def _to_json(item: Any) -> Any:
    return item.to_json()


class JsonFragments:
    """Each object's ``encode(item)`` (by default its ``to_json()``) encoded once, by identity
    (the object is held, so its id is not reused); remembers only the objects of the last
    array it made."""

    def __init__(self, encode: Callable[[Any], Any] = _to_json) -> None:
        self._encode = encode
        self._known: dict[int, tuple[object, str]] = {}
        #: Objects encoded by the last :meth:`array` (the rest were joined as they were).
        self.encoded_last = 0

    def array(self, items: Iterable[Any]) -> str:
        """The JSON array of the items' ``to_json()``, as ``json.dumps(sort_keys=True)``."""
        fresh: dict[int, tuple[object, str]] = {}
        parts = []
        encoded = 0
        for item in items:
            known = self._known.get(id(item))
            if known is None or known[0] is not item:
                known = (item, json.dumps(self._encode(item), sort_keys=True))
                encoded += 1
            fresh[id(item)] = known
            parts.append(known[1])
        self._known, self.encoded_last = fresh, encoded
        return "[" + ", ".join(parts) + "]"


class SidecarFragments:
    """A snapshot writer's fragments: replay groups, finalizer results and journal entries
    (one writer at a time: the snapshotter's save lock); with ``segments``, the ledger
    sidecar is written as a chain of what changed (:meth:`SegmentWriter.stage_ledger`,
    schema 6)."""

    def __init__(self, segments: SegmentWriter | None = None) -> None:
        self.replay = JsonFragments()
        self.results = JsonFragments()
        #: The runtime state's ``journal`` entries and ``training_journal.json``'s steps.
        self.journal = JsonFragments(journal_entry_json)
        self.journal_steps = JsonFragments(TrainedStep.journal_json)
        self.segments = segments

    def training_journal(self, captured: CapturedRolloutState) -> bytes:
        """``training_journal.json`` of ``captured``, its steps encoded once each (the last
        one afresh while it lists the drops since: :func:`.state.training_journal_json`)."""
        entries = captured.journal_entries
        last = ""
        if captured.pending_drops and entries:
            extra = tuple(captured.pending_drops)
            last = json.dumps(entries[-1].journal_json(extra), sort_keys=True)
            entries = entries[:-1]
        steps = self.journal_steps.array(entries)
        if last:
            steps = f"{steps[:-1]}, {last}]" if entries else f"[{last}]"
        return _dumps_with({"schema": TRAINING_JOURNAL_SCHEMA}, {"steps": steps})


def _dumps_with(document: Mapping[str, Any], arrays: Mapping[str, str]) -> bytes:
    """``json.dumps({**document, **arrays}, sort_keys=True)`` with the ``arrays`` values
    already encoded: a unique placeholder is encoded in each one's place, then replaced."""
    tokens = {key: f"@{uuid.uuid4().hex}@" for key in arrays}
    text = json.dumps({**document, **tokens}, sort_keys=True)
    for key, token in tokens.items():
        text = text.replace(json.dumps(token), arrays[key], 1)
    return text.encode()


def write_controller_sidecars(
    captured: CapturedRolloutState,
    data_plane_files: DataPlaneFiles | None = None,
    fragments: SidecarFragments | None = None,
) -> dict[str, bytes]:
    """Serialize a capture: the files both checkpoint kinds hold (runs off the loop).

    ``fragments`` (a snapshot's, with its segment writer as ``data_plane_files``, which
    keeps no replay view in the data plane's metadata): per-object JSON reused."""
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
    segmented = fragments is not None and data_plane_files is not None
    replay_json = [] if segmented else [group.to_json() for group in captured.replay_view]
    if captured.ledger_capture is not None:
        chained = fragments.segments if segmented and fragments is not None else None
        if chained is not None and not captured.restart_from_turn_zero:
            sidecar = chained.stage_ledger(captured.ledger_capture)
        else:  # a trainer checkpoint, or a document edited after the cut: whole (schema 5)
            sidecar = encode_captured_ledger(captured)
        files[LEDGER_FILE] = sidecar.data
        captured.controller_state["rollout_recovery"] = sidecar.metadata()
        captured.data_plane_metadata.update(sidecar.metadata())
    dp_metadata = dict(captured.data_plane_metadata)
    if not segmented:
        dp_metadata["replay"] = replay_json
    pack = data_plane_files or DataPlane.to_files
    for name, data in pack(captured.data_plane, dp_metadata).items():
        files[DATA_PLANE_PREFIX + name] = data
    crash_point("after_data_plane_save")
    if fragments is not None and segmented:
        replay = fragments.replay.array(captured.replay_view)
        files[CONTROLLER_STATE_FILE] = _dumps_with(captured.controller_state, {"replay": replay})
        arrays = {
            "finalizer_results": fragments.results.array(captured.finalizer_results),
            "journal": fragments.journal.array(captured.journal_entries),
        }
        files[RUNTIME_STATE_FILE] = _dumps_with(captured.runtime_state_rest, arrays)
        files[JOURNAL_FILE] = fragments.training_journal(captured)
    else:
        controller_state = {**captured.controller_state, "replay": replay_json}
        files[CONTROLLER_STATE_FILE] = json.dumps(controller_state, sort_keys=True).encode()
        finalized = [r.to_json() for r in captured.finalizer_results]
        runtime_state = {**captured.runtime_state, "finalizer_results": finalized}
        files[RUNTIME_STATE_FILE] = json.dumps(runtime_state, sort_keys=True).encode()
        files[JOURNAL_FILE] = json.dumps(captured.journal, sort_keys=True).encode()
    if captured.environment_snapshot is not None:
        files[ENVIRONMENT_FILE] = captured.environment_snapshot.to_bytes()
    return files

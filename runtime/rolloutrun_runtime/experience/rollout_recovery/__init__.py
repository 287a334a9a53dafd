"""The recovery ledger and the ids of every rollout (the seed's ``experience/rollout_recovery``).

Why: a preempted run must neither lose a prompt nor train one twice, and the trainer, the
data plane and the Gym must name every attempt the same way. This package is the one owner of
both: :mod:`.ids` builds and parses every id, :mod:`.records` holds groups -> siblings ->
attempts, :mod:`.ledger` changes them by checked transitions and :mod:`.sidecar` saves and
reads them beside the data plane's checkpoint (its schema version and file name are in
:mod:`rolloutrun_runtime.contract.layout`). Import from this package face; the modules
behind it are its own business.
"""

from rolloutrun_runtime.experience.rollout_recovery.ids import (
    RolloutIdError,
    new_uuid_hex,
    parse_row_key,
    rollout_id_for,
    row_key_for,
    sibling_id_for,
    split_rollout_id,
    valid_rollout_id,
)
from rolloutrun_runtime.experience.rollout_recovery.ledger import RecoveryLedger
from rolloutrun_runtime.experience.rollout_recovery.records import (
    AttemptStatus,
    EnvironmentEpisode,
    Granularity,
    GroupPhase,
    GroupStatus,
    LedgerError,
    LedgerRestartError,
    LedgerSidecarError,
    LedgerTransitionError,
    LiveCut,
    PromptGroupRecord,
    PromptRef,
    RestartReport,
    RestoreLevel,
    RolloutAttempt,
    SiblingRecord,
    new_attempt,
    relaunch_reason,
)
from rolloutrun_runtime.experience.rollout_recovery.sidecar import (
    LedgerSidecar,
    RecoveredLedger,
    SidecarCapture,
    encode_sidecar,
    read_recovery_sidecar,
)

__all__ = [
    "AttemptStatus",
    "EnvironmentEpisode",
    "Granularity",
    "GroupPhase",
    "GroupStatus",
    "LedgerError",
    "LedgerRestartError",
    "LedgerSidecar",
    "LedgerSidecarError",
    "LedgerTransitionError",
    "LiveCut",
    "PromptGroupRecord",
    "PromptRef",
    "RecoveredLedger",
    "RecoveryLedger",
    "RestartReport",
    "RestoreLevel",
    "RolloutAttempt",
    "RolloutIdError",
    "SiblingRecord",
    "SidecarCapture",
    "encode_sidecar",
    "new_attempt",
    "new_uuid_hex",
    "parse_row_key",
    "read_recovery_sidecar",
    "relaunch_reason",
    "rollout_id_for",
    "row_key_for",
    "sibling_id_for",
    "split_rollout_id",
    "valid_rollout_id",
]

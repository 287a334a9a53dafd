"""The recovery ledger and the ids of every rollout (the seed's ``experience/rollout_recovery``).

Why: a preempted run must neither lose a prompt nor train one twice, and the trainer, the
data plane and the Gym must name every attempt the same way. This package is the one owner of
both: :mod:`.ids` builds and parses every id, :mod:`.ledger` records groups -> siblings ->
attempts with checked transitions and saves them as a sidecar beside the data plane's
checkpoint. Import from this package face; the modules behind it are its own business.
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
from rolloutrun_runtime.experience.rollout_recovery.ledger import (
    LEDGER_SCHEMA_VERSION,
    READABLE_SCHEMA_VERSIONS,
    SIDECAR_NAME,
    AttemptStatus,
    EnvironmentEpisode,
    Granularity,
    GroupPhase,
    GroupStatus,
    LedgerError,
    LedgerRestartError,
    LedgerSidecar,
    LedgerSidecarError,
    LedgerTransitionError,
    LiveCut,
    PromptGroupRecord,
    PromptRef,
    RecoveredLedger,
    RecoveryLedger,
    RestartReport,
    RestoreLevel,
    RolloutAttempt,
    SiblingRecord,
    encode_sidecar,
    new_attempt,
    read_recovery_sidecar,
    relaunch_reason,
)

__all__ = [
    "LEDGER_SCHEMA_VERSION",
    "READABLE_SCHEMA_VERSIONS",
    "SIDECAR_NAME",
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

"""The restore half's reading steps: one durable entry's files, read into checked parts.

Why apart from :mod:`.restore`: choosing what to resume from is a loop over entries with
logging and tracing; reading one entry is a sequence of pure steps over its bytes (controller
state, runtime state, data plane, ledger, the steps to replay, the inventory, the cursor and
the capacity), each of which either returns a part or raises :class:`RestoreError` naming
the problem. Nothing here touches storage, the environment or a live part of the run, so a
refused entry leaves nothing behind; ``RolloutRestorer`` assembles the parts into a
``RestoredRolloutState`` only when every step passed.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from typing import Any

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.inventory import (
    require_complete,
    take_inventory,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CONTROLLER_STATE_SCHEMA,
    RolloutRuntimeState,
    TrainedStep,
)
from rolloutrun_runtime.contract.layout import (
    CONTROLLER_STATE_FILE,
    DATA_PLANE_PREFIX,
    DATA_SEGMENTS_PREFIX,
    LEDGER_FILE,
    RUNTIME_STATE_FILE,
)
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.experience.rollout_recovery import (
    GroupStatus,
    LedgerError,
    PromptRef,
    RecoveryLedger,
    read_recovery_sidecar,
)

logger = logging.getLogger(__name__)


class RestoreError(RuntimeError):
    """A checkpoint cannot be restored; nothing of it was installed."""


def relaunch_count(ledger: RecoveryLedger | None) -> int:
    """Groups a restart relaunches, after a dry run of its normalization on a copy."""
    if ledger is None:
        return 0
    trial = copy.deepcopy(ledger)
    trial.prepare_for_restart(_PlanningCut())
    return len(trial.with_status(GroupStatus.GENERATING, GroupStatus.READY_TO_FINALIZE))


def check_capacity(relaunched: int, replayed: int, capacity: int) -> None:
    """The restored groups (relaunched + in replay) must fit ``rollout.replayCapacity``."""
    if relaunched + replayed > capacity:
        raise RestoreError(
            f"restored work exceeds rollout.replayCapacity ({relaunched} groups to relaunch + "
            f"{replayed} in replay > {capacity})"
        )


class _PlanningCut:
    """Stands for the barrier cut in a dry run on a copy (nothing shared is mutated)."""

    def require_live(self) -> None:
        return None


def check_cursor(prompts: list[PromptRef], dataloader_state: Mapping[str, Any]) -> None:
    """Every restored prompt must lie before the dataloader cursor (else it would repeat)."""
    cursor = (int(dataloader_state["epoch"]), int(dataloader_state["position"]))
    ahead = [p for p in prompts if (p.epoch, p.index) >= cursor]
    if ahead:
        raise RestoreError(
            f"{len(ahead)} restored prompts lie at or past the dataloader cursor "
            f"(epoch {cursor[0]}, position {cursor[1]}), e.g. prompt {ahead[0].prompt_id} at "
            f"epoch {ahead[0].epoch}, position {ahead[0].index}"
        )


# ---------------------------------------------------------------------- reading steps
def read_controller_state(
    files: Mapping[str, bytes], fallback_state: Mapping[str, Any] | None, where: str
) -> dict[str, Any]:
    """The controller state (older trainer checkpoints kept it in trainer_state.json)."""
    if CONTROLLER_STATE_FILE in files:
        controller = json.loads(files[CONTROLLER_STATE_FILE])
        if controller.get("schema") != CONTROLLER_STATE_SCHEMA:
            raise RestoreError(
                f"{where}: controller state schema {controller.get('schema')!r} is not "
                f"readable (this runtime reads {CONTROLLER_STATE_SCHEMA})"
            )
        return controller
    if fallback_state is not None:
        return dict(fallback_state)
    raise RestoreError(f"{where}: lacks {CONTROLLER_STATE_FILE}")


def read_runtime_state(
    files: Mapping[str, bytes], where: str, *, deterministic: bool
) -> RolloutRuntimeState:
    """The rollout runtime state (empty when the entry predates it)."""
    runtime_json = json.loads(files[RUNTIME_STATE_FILE]) if RUNTIME_STATE_FILE in files else {}
    runtime = RolloutRuntimeState.from_json(runtime_json) if runtime_json else RolloutRuntimeState()
    if deterministic and not RolloutRuntimeState.keeps_reserves(runtime_json):
        logger.warning(
            "%s keeps no spare reserves (written by an older runtime): groups of the steps "
            "it admitted are replaced from the spare pool in finishing order, so this "
            "resume is not bit-identical until those steps are trained",
            where,
        )
    return runtime


def read_data_plane(files: Mapping[str, bytes]) -> tuple[DataPlane, dict[str, Any]]:
    """The data plane and its checkpoint metadata (empty when the entry holds none)."""
    dp_files = {
        name[len(DATA_PLANE_PREFIX) :]: data
        for name, data in files.items()
        if name.startswith(DATA_PLANE_PREFIX)
    }
    segments = {
        name: data for name, data in files.items() if name.startswith(DATA_SEGMENTS_PREFIX + "/")
    }
    if dp_files:
        return DataPlane.from_files(dp_files, segments)
    return DataPlane(), {}


def read_ledger(
    files: Mapping[str, bytes],
    controller: Mapping[str, Any],
    runtime: RolloutRuntimeState,
    *,
    uses_ledger: bool,
) -> RecoveryLedger | None:
    """The ledger, checked against what the checkpoint recorded about it; the rollout state
    saved beside it goes into ``runtime``."""
    if LEDGER_FILE not in files:
        return RecoveryLedger() if uses_ledger else None
    facts = controller.get("rollout_recovery", {})
    recovered = read_recovery_sidecar(
        files[LEDGER_FILE],
        expected_sha256=facts.get("rollout_recovery_sha256"),
        expected_schema=facts.get("rollout_recovery_schema"),
        expected_group_count=facts.get("rollout_recovery_groups"),
        chunks=files,
    )
    runtime.batch_shortfall = dict(recovered.batch_shortfall)
    runtime.sampler_stamps_target_steps = recovered.sampler_stamps_target_steps
    # the spare pool: schema >= 5 always carries one (maybe empty); schema 4 may not
    if recovered.spare_prompts is not None:
        runtime.spare_prompts = list(recovered.spare_prompts)
    return recovered.ledger


def replay_since_anchor(
    runtime: RolloutRuntimeState, anchor_step: int, train_step: int, where: str
) -> tuple[set[str], list[TrainedStep]]:
    """The rows the anchor's checkpoint releases, and the steps to retrain after it (every
    one from the anchor to the entry's train step, each with its rows kept)."""
    # a trainer checkpoint covers every step it holds: release their replay rows
    released = set(runtime.advance_replay_anchor(anchor_step))
    replay_steps = runtime.replay_steps(anchor_step)
    expected = list(range(anchor_step + 1, train_step + 1))
    if [s.step for s in replay_steps] != expected:
        raise RestoreError(
            f"{where}: anchored to step {anchor_step} at train step {train_step}, it must "
            f"replay steps {expected}, but its journal holds "
            f"{[s.step for s in replay_steps]}"
        )
    if any(not s.row_groups and s.groups for s in replay_steps):
        raise RestoreError(f"{where}: a step to replay has no rows kept")
    return released, replay_steps


def clear_unreferenced(
    plane: DataPlane,
    replay_groups: list[ReplayGroup],
    runtime: RolloutRuntimeState,
    ledger: RecoveryLedger | None,
    released: set[str],
    where: str,
) -> None:
    """Check the inventory (every referenced row is there), then clear what nothing
    references (in the restored copy, not yet installed)."""
    inventory = take_inventory(
        plane,
        replay_view=replay_groups,
        retained_row_keys=runtime.retained_row_keys(),
        ledger=ledger,
    )
    require_complete(inventory, where)
    unexpected = set(inventory.orphan_train) - released
    if unexpected:
        logger.warning("%s: clearing %d unreferenced train rows", where, len(unexpected))
    plane.clear("train", inventory.orphan_train)
    plane.clear("staging", inventory.orphan_staging)


def check_restored_work(
    runtime: RolloutRuntimeState,
    ledger: RecoveryLedger | None,
    dataloader_state: Mapping[str, Any],
    replayed: int,
    capacity: int,
    where: str,
) -> None:
    """The cursor must cover the restored work, and the relaunch (tried on a copy:
    normalization, then the capacity) must fit ``rollout.replayCapacity``."""
    prompts = list(runtime.spare_prompts) + runtime.reserved_prompts()
    if ledger is not None:
        prompts.extend(group.prompt for group in ledger.groups())
    check_cursor(prompts, dataloader_state)
    try:
        relaunched = relaunch_count(ledger)
    except LedgerError as error:
        raise RestoreError(f"{where}: {error}") from error
    check_capacity(relaunched, replayed, capacity)

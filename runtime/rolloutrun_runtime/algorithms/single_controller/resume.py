"""Resume: install a checked restore into the run state and relaunch its unfinished work.

Why its own part: the restorer (``rollout_checkpointing/restore.py``) reads, verifies and
decides which entry to resume from and never touches the live run; this part is the other
half, which does. ``restore`` runs before the pumps start: it loads the weights, optimizer
and RNG, fills the run state in place (``RunState.install``: the snapshotter already holds
those parts and sees the restored ones), retrains the steps a snapshot carries past its
anchor (``TrainPump.retrain``), syncs the generation workers, and (turn level) opens the
environment's restore scope, which hands copied episodes back to the Gym.

``relaunch`` runs when the run starts: under the barrier's exclusive cut it normalizes the
restored ledger for a restart (the environment scope closes there: kept, or dropped if the
ledger refuses it), clears stale staged rows, and rebuilds a ``GroupRun`` for each
unfinished group, which the rollout pump relaunches before it admits new prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Mapping
from typing import Any

from rolloutrun_runtime.algorithms.gym_client import carries_record
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import (
    RestoredRolloutState,
    ResumeChoice,
    RolloutRestorer,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.algorithms.single_controller.rollout_pump import GroupRun, RolloutPump
from rolloutrun_runtime.algorithms.single_controller.run_state import ControllerError, RunState
from rolloutrun_runtime.algorithms.single_controller.train_pump import TrainPump, weights_for_refit
from rolloutrun_runtime.algorithms.trainer_checkpoint import restore_rng
from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    GroupStatus,
    RecoveryLedger,
    split_rollout_id,
)
from rolloutrun_runtime.metrics import STARTUP
from rolloutrun_runtime.workers import PolicyWorkers

logger = logging.getLogger(__name__)


class Resume:
    """Installs a restore into the run state and relaunches what it left unfinished."""

    def __init__(
        self,
        state: RunState,
        *,
        restorer: RolloutRestorer,
        rollouts: RolloutPump,
        train: TrainPump,
        workers: PolicyWorkers,
        trace: TraceWriter,
    ) -> None:
        self.state = state
        self.restorer = restorer
        self.rollouts = rollouts
        self.train = train
        self.workers = workers
        self.trace = trace
        self.restored_episodes: dict[str, str] = {}
        #: The environment's restore scope: open from restore() until the ledger accepted it.
        self._environment_restore = contextlib.AsyncExitStack()
        self._restored_from: RestoredRolloutState | None = None

    async def restore(self, planned: ResumeChoice | None = None) -> RestoredRolloutState | None:
        """Resume from the best source (see ``RolloutRestorer``); None for a fresh run.

        Runs before ``run``: the restorer reads, verifies and decides the newest restorable
        entry first (a refused one is skipped, nothing of it installed; every one refused
        raises ``UnrestorableError``), then this installs it, retrains the steps a snapshot
        carries past its anchor, syncs the generation workers, and (turn level) hands copied
        episodes back to the Gym. ``planned``: that decision, already made by the caller
        (the trainer plans before it builds the model, to build it on the anchor's weights).
        """
        choice = planned
        if choice is None:
            choice = await asyncio.to_thread(self.restorer.plan)
            STARTUP.mark("restore_read")
        restored = choice.restored
        if restored is None:
            return None
        self.install(restored)
        STARTUP.mark("restore_installed")
        state = self.state
        await self.workers.refit(weights_for_refit(state.model), state.trainer_version)
        STARTUP.mark("workers_refit")
        self.restored_episodes = await self._environment_restore.enter_async_context(
            self.restorer.environment_restore_scope(restored)
        )
        state.environment_restore = self.restorer.environment_restore  # in every step record
        return restored

    def install(self, restored: RestoredRolloutState) -> None:
        """Install a checked restore and retrain its replay steps (before ``run``)."""
        state = self.state
        if restored.trainer is not None:
            state.model.load_state_dict(restored.trainer.model_state)
            state.optimizer.load_state_dict(restored.trainer.optimizer_state)
            restore_rng(restored.trainer.rng_state)
        state.install(restored)
        for entry in restored.replay_steps:
            self.train.retrain(entry)
        if state.trainer_version != restored.train_step:
            raise ControllerError(
                f"replay reached step {state.trainer_version}, expected {restored.train_step}"
            )
        state.served_version = state.trainer_version
        state.durable_step = restored.anchor_step if restored.anchor_step > 0 else None
        state.resume = restored.source
        self._restored_from = restored
        logger.info(
            "restored %s: anchor step %d, %d steps retrained, %d groups in replay",
            restored.source.path,
            restored.anchor_step,
            len(restored.replay_steps),
            len(restored.replay_groups),
        )

    async def relaunch(self) -> None:
        """Normalize a restored ledger and relaunch its unfinished groups before new prompts."""
        state = self.state
        if state.resume.fresh:
            return
        if state.ledger is None:
            for _ in range(len(state.buffer)):
                await state.buffer.acquire_permit()
            self._trace_restore(0)
            return
        ledger = state.ledger
        carried = self._carried_records()
        owners = {**self.restored_episodes, **{r: owner for r, (owner, _) in carried.items()}}
        async with state.barrier.checkpoint() as cut:
            async with self._environment_restore:  # kept; dropped if the ledger refuses it
                report = ledger.prepare_for_restart(cut, owners)
            for resumed in report.resumed:
                level = "member" if resumed.rollout_id in carried else "turn"
                self._trace_restarted(ledger, resumed.rollout_id, "attempt_restored", level=level)
            for episode in report.abandoned:
                self._trace_restarted(
                    ledger, episode.rollout_id, "attempt_abandoned", reason="restart"
                )
            runs = self._unfinished_groups(ledger, report.stale_row_keys)
            resumed_ids = {episode.rollout_id for episode in report.resumed}
            _carry(ledger, runs, {r: v for r, v in carried.items() if r in resumed_ids})
        for _ in range(len(runs) + len(state.buffer)):
            if state.buffer.permits.locked():
                raise ControllerError("restored work exceeds rollout.replayCapacity")
            await state.buffer.acquire_permit()
        for run in runs:
            state.launch(self.rollouts.run_group(run), run.group_id)
        self._trace_restore(len(runs))
        logger.info(
            "resumed at step %d: %d groups relaunched, %d in replay, %d abandoned attempts",
            state.trainer_version,
            len(runs),
            len(state.buffer),
            len(report.abandoned),
        )

    def _carried_records(self) -> dict[str, tuple[str, Mapping[str, Any]]]:
        """The restore's episodes a down replica did not take that go on from their records
        as a lost replica's do mid-run (``RolloutPump._member_resume``: the ``/run`` carries
        the record, to the owner's replacement once it answers, else to a survivor). Only
        where some replica takes a record and it fits in a ``/run``: a ``/run`` for attempt
        + 1 without it would start the episode over under the same rollout id and repeat its
        side effects, so every other restarts from turn 0 under a new one."""
        if not self.rollouts.gym.resumes():
            return {}
        limit = self.state.cfg.gym.request_max_bytes
        return {
            rollout_id: (owner, record)
            for rollout_id, (owner, record) in self.restorer.unavailable_episodes.items()
            if carries_record(record, limit)
        }

    def _trace_restarted(
        self, ledger: RecoveryLedger, rollout_id: str, event: str, **fields: Any
    ) -> None:
        sibling_id, attempt_uuid = split_rollout_id(rollout_id)
        group = ledger.group_of(sibling_id)
        self.trace.emit(
            event,
            group_id=group.group_id,
            prompt_id=group.prompt.prompt_id,
            generation_index=ledger.sibling(sibling_id).index,
            attempt_uuid=attempt_uuid,
            **fields,
        )

    def _unfinished_groups(
        self, ledger: RecoveryLedger, stale_row_keys: list[str]
    ) -> list[GroupRun]:
        """Clear the staged rows no sealed attempt refers to and rebuild a ``GroupRun`` for
        each group still generating or finalizing (under the restart cut)."""
        state = self.state
        state.data_plane.clear("staging", stale_row_keys)
        referenced = ledger.referenced_row_keys()
        state.data_plane.clear(
            "staging", [k for k in state.data_plane.list("staging") if k not in referenced]
        )
        runs: list[GroupRun] = []
        for record in ledger.with_status(GroupStatus.GENERATING, GroupStatus.READY_TO_FINALIZE):
            target_step = record.target_step or state.trainer_version + 1
            place = state.runtime_state.place_of(
                target_step, record.prompt.prompt_id, record.prompt.epoch
            )
            run = GroupRun(
                record.group_id,
                record.prompt,
                target_step,
                record.start_weight_version,
                slot=place[0] if place is not None else None,
            )
            for sibling in record.siblings:
                current = sibling.current
                if current.status is AttemptStatus.SEALED and current.row_key:
                    run.staged[sibling.index] = current.row_key
            runs.append(run)
        return runs

    def _trace_restore(self, redispatched: int) -> None:
        restored = self._restored_from
        STARTUP.mark("relaunched")
        self.trace.emit(
            "restore_completed",
            snapshot_id=restored.snapshot_id if restored else None,
            cut_time=restored.cut_time if restored else None,
            groups=len(self.state.buffer),
            redispatched=redispatched,
            startup=STARTUP.phases(),  # where this process's start-up went (bench)
            # torch._dynamo costs 1.5-2 s of start-up; nothing on this path needs it
            dynamo_imported="torch._dynamo" in sys.modules,
        )


def _carry(
    ledger: RecoveryLedger,
    runs: list[GroupRun],
    records: Mapping[str, tuple[str, Mapping[str, Any]]],
) -> None:
    """Each resumed episode's record on its relaunched group's sibling (``GroupRun.resume``),
    where the rollout pump sends it with the sibling's next ``/run``."""
    by_group = {run.group_id: run for run in runs}
    for rollout_id, (_, record) in records.items():
        sibling_id, _ = split_rollout_id(rollout_id)
        run = by_group.get(ledger.group_of(sibling_id).group_id)
        if run is not None:
            run.resume[ledger.sibling(sibling_id).index] = record

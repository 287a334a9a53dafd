"""The single controller: assembles a run's parts and starts them; GRPO runs in the parts.

Why the controller is only wiring: the rollout pump and the train pump run concurrently
and meet only through shared state, and the checkpoint halves must see that same state, so
the controller builds one ``RunState`` (every live part), hands it to each part once, and
starts the pumps. Nothing is rebuilt later: a restore fills the run state in place.

The parts and what each owns:

- ``run_state.py``: the parts themselves (data plane, barrier, replay buffer, dataloader,
  sampler, ledger, rollout runtime state, save lock, policy and optimizer, the version
  counters) and the progress event the pumps wake each other with;
- ``rollout_pump.py``: admission, prompt reservation, sibling dispatch, sealing and
  finalizing groups (the ``prompt_reservations``, ``rollout_*``, ``group_commits`` and
  ``group_discards`` mutations);
- ``drop_policy.py``: what a dropped group becomes, and the spare pool and reserves;
- ``train_pump.py``: selecting, training and committing steps (``group_removals``, and
  ``sample_clears``: the optimizer-commit window);
- ``checkpoints.py``: trainer checkpoints (the save lock, then the exclusive cut);
- ``resume.py``: installing a restore and relaunching its unfinished groups;
- ``hooks.py``: what the run reports to the process around it (``RunHooks``).

The snapshotter (``rollout_checkpointing/snapshots.py``) reads the run state's ``parts``
and calls the snapshot hooks; the restorer (``rollout_checkpointing/restore.py``) decides
what to resume from and never touches the live run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from rolloutrun_runtime.algorithms.gym_client import GymClient
from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import (
    RestoredRolloutState,
    ResumeChoice,
    RolloutRestorer,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots_decisions import (
    SnapshotOutcome,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CapturedRolloutState,
    ResumeSource,
    RolloutParts,
    RolloutRuntimeState,
    TrainingProgress,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.algorithms.samplers import InOrderSampler, PromptDataloader
from rolloutrun_runtime.algorithms.single_controller.checkpoints import TrainerCheckpoints
from rolloutrun_runtime.algorithms.single_controller.hooks import NoHooks, RunHooks
from rolloutrun_runtime.algorithms.single_controller.resume import Resume
from rolloutrun_runtime.algorithms.single_controller.rollout_pump import RolloutPump
from rolloutrun_runtime.algorithms.single_controller.run_state import ControllerError, RunState
from rolloutrun_runtime.algorithms.single_controller.train_pump import TrainPump
from rolloutrun_runtime.algorithms.trainer_checkpoint import TrainerCapture, TrainerCheckpointer
from rolloutrun_runtime.contract.pod import MemberEndpoint
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.data_plane import DataPlane, DataPlaneBarrier
from rolloutrun_runtime.environments.checkpointing import EnvironmentCheckpoint, EnvironmentEpisode
from rolloutrun_runtime.experience.rollout_recovery import LiveCut, RecoveryLedger
from rolloutrun_runtime.metrics import STARTUP, OverheadClock
from rolloutrun_runtime.workers import PolicyWorkers, SharesTrainerLoop

logger = logging.getLogger(__name__)

#: A preemption's forced snapshot that met an optimizer commit tries again this much later.
COMMIT_WINDOW_RETRY_S = 0.05


class SingleController:
    """Runs GRPO to ``maxSteps``: one rollout pump, one train pump, shared state."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        workers: PolicyWorkers,
        gym_endpoints: list[str],
        checkpointer: TrainerCheckpointer | None = None,
        pad_id: int = 0,
        trace: TraceWriter | None = None,
        manifests: ManifestStore | None = None,
        environment: EnvironmentCheckpoint | None = None,
        hooks: RunHooks | None = None,
        gym_token: str | None = None,
        prompt_payload: Callable[[int], Mapping[str, Any]] | None = None,
        gym_members: Callable[[bool], Mapping[int, MemberEndpoint]] | None = None,
    ) -> None:
        """``gym_members``: where replaced Gym replicas serve now (the operator's Lease
        annotation in a pod; asked to read afresh while one is down), or None."""
        if cfg.rollout.replay_capacity < cfg.grpo.prompts_per_step:
            raise ControllerError(
                f"rollout.replayCapacity ({cfg.rollout.replay_capacity}) must be at least "
                f"grpo.promptsPerStep ({cfg.grpo.prompts_per_step}): a step could never fill"
            )
        self.cfg = cfg
        self.workers = workers
        self.manifests = manifests
        self.environment = environment
        self.gym_members = gym_members
        self.hooks: RunHooks = hooks if hooks is not None else NoHooks()
        self.trace = trace if trace is not None else TraceWriter(None)
        self.overhead = OverheadClock()
        self.gym = GymClient(
            gym_endpoints,
            timeout_s=cfg.rollout.rollout_timeout_seconds,
            max_seq_len=cfg.policy.max_seq_len,
            overhead=self.overhead,
            unreachable_budget_s=cfg.rollout.gym_unreachable_seconds,
            token=gym_token,
            prompt_payload=prompt_payload,
            # without standbys every endpoint given is active (as before the field)
            active=cfg.gym.replicas if cfg.gym.standby else None,
        )
        if environment is not None:  # a restored or snapshotted episode's owner moves too
            self.gym.on_replaced = lambda r: environment.readdress(r.instance_id, r.url)
            self.gym.on_down = lambda r, why: environment.lost(r.instance_id, why)
        self.state = RunState(cfg, model, optimizer)
        self.rollout_snapshots = RolloutSnapshotter(
            self.state.parts,
            manifests=manifests,
            anchor_is_durable=checkpointer.is_durable if checkpointer is not None else None,
            environment=environment,
            trace=self.trace,
            fence=self.hooks.fence,
            on_published=self.hooks.on_published,
            on_record=self.hooks.on_snapshot,
            # The manifest names its writer's incarnation, as a checkpoint's marker does.
            incarnation=checkpointer.writer.incarnation if checkpointer is not None else 0,
            generation_idle=workers.until_idle if isinstance(workers, SharesTrainerLoop) else None,
        )
        self.rollout_restorer = RolloutRestorer(
            cfg,
            manifests=manifests,
            checkpointer=checkpointer,
            environment=environment,
            trace=self.trace,
        )
        self._assemble(checkpointer, pad_id)

    def _published_turn_record(self, rollout_id: str, attempt: int) -> Mapping[str, Any] | None:
        """The newest published snapshot's record of an episode (elastic members)."""
        published = self.rollout_snapshots.published_environment
        if published is None:
            return None
        return published.record_of(EnvironmentEpisode(rollout_id, attempt, ""))

    def _assemble(self, checkpointer: TrainerCheckpointer | None, pad_id: int) -> None:
        """Build the parts over the one run state (each gets only what it uses)."""
        state, trace, overhead = self.state, self.trace, self.overhead
        every_rollouts = self.cfg.checkpointing.snapshot_every_rollouts
        self.rollout_pump = RolloutPump(
            state,
            gym=self.gym,
            workers=self.workers,
            trace=trace,
            overhead=overhead,
            on_dispatched=(
                (lambda: self.rollout_snapshots.rollout_dispatched(every_rollouts))
                if every_rollouts > 0
                else None
            ),
            turn_records=self._published_turn_record,
        )
        self.checkpoints = TrainerCheckpoints(
            state,
            checkpointer=checkpointer,
            manifests=self.manifests,
            snapshots=self.rollout_snapshots,
            hooks=self.hooks,
        )
        self.train_pump = TrainPump(
            state,
            rollouts=self.rollout_pump,
            checkpoints=self.checkpoints,
            snapshots=self.rollout_snapshots,
            gym=self.gym,
            workers=self.workers,
            hooks=self.hooks,
            trace=trace,
            overhead=overhead,
            pad_id=pad_id,
        )
        self.resumption = Resume(
            state,
            restorer=self.rollout_restorer,
            rollouts=self.rollout_pump,
            train=self.train_pump,
            workers=self.workers,
            trace=trace,
        )

    # ================================================================== run
    async def run(self) -> list[dict[str, Any]]:
        """Run both pumps until ``maxSteps`` steps are trained; returns the step records."""
        if self.manifests is not None:
            await asyncio.to_thread(self.rollout_snapshots.ensure_bootstrap_anchor)
        STARTUP.mark("bootstrap_anchor_checked")
        await self.gym.open(self.gym_members)  # a replica not answering yet opens as down
        STARTUP.mark("gym_opened")
        try:
            await self.resumption.relaunch()
            rollout = asyncio.create_task(self.rollout_pump.run(), name="rollout-pump")
            train = asyncio.create_task(self.train_pump.run(), name="train-pump")
            snapshots = asyncio.create_task(
                self.rollout_snapshots.run_pump(
                    self.cfg.checkpointing.snapshot_interval_seconds,
                    self.cfg.checkpointing.snapshot_every_steps,
                    self.cfg.checkpointing.snapshot_every_rollouts,
                ),
                name="snapshot-pump",
            )
            members = asyncio.create_task(
                self.gym.watch_members(self.gym_members), name="gym-members"
            )
            try:
                pending = {rollout, train, snapshots}
                while not train.done():
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()
            finally:
                for task in (rollout, train, snapshots, members, *self.state.tasks):
                    task.cancel()
                await asyncio.gather(
                    rollout, train, snapshots, members, *self.state.tasks, return_exceptions=True
                )
            await self.finalize_deferred_checkpoint()
            if self.checkpointer is not None and self.state.durable_step != self.trainer_version:
                # The run always ends with a trainer checkpoint at maxSteps.
                await self.trainer_checkpoint(defer=False)
        finally:
            await self.gym.close()
            await self.rollout_pump.policies.close()
        return self.history

    async def preemption_snapshot(self, grace_s: float) -> str:
        """SIGTERM: hold training (``TrainingHold``), force a snapshot that publishes within
        ``grace_s``, and one more when the step the notice found computing committed since
        (it may have landed after the first one's cut; waited for at most half the grace
        left); returns the last outcome."""
        deadline = time.monotonic() + grace_s
        self.trace.emit("preemption_notice", deadline=time.time() + grace_s)
        self.state.training.hold()
        version_at_notice = self.state.trainer_version
        if self.manifests is None:
            return "no_storage"
        outcome = await forced_snapshot(self._preemption_attempt, deadline)
        if outcome is None:
            return "timed_out"
        settled = await self.state.training.idle((deadline - time.monotonic()) / 2)
        if settled and self.state.trainer_version != version_at_notice:
            outcome = await forced_snapshot(self._preemption_attempt, deadline) or outcome
        return outcome.value

    def _preemption_attempt(self) -> Awaitable[SnapshotOutcome]:
        return self.rollout_snapshots.attempt(force=True, reason="preemption")

    # ================================================================== checkpoints, restore
    def capture_trainer_state(self, cut: LiveCut) -> tuple[TrainerCapture, CapturedRolloutState]:
        """In-memory copies of everything a trainer checkpoint saves (call under the cut)."""
        return self.checkpoints.capture(cut)

    async def trainer_checkpoint(self, *, defer: bool | None = None) -> None:
        """Save ``step_<N>`` for the current version (deferred finalize if configured)."""
        await self.checkpoints.save(defer=defer)

    async def finalize_deferred_checkpoint(self) -> None:
        """Publish a deferred trainer checkpoint (at a step boundary, or at the end)."""
        await self.checkpoints.finalize_deferred()

    async def restore(self, planned: ResumeChoice | None = None) -> RestoredRolloutState | None:
        """Resume from the best source, or from ``planned`` when the caller already chose it
        (see ``Resume.restore``); None for a fresh run."""
        restored = await self.resumption.restore(planned)
        if restored is not None:
            self.rollout_snapshots.resumed_from(restored.segment_seed)
        return restored

    def install_restored(self, restored: RestoredRolloutState) -> None:
        """Install a checked restore and retrain its replay steps (before ``run``)."""
        self.resumption.install(restored)
        self.rollout_snapshots.resumed_from(restored.segment_seed)

    # ================================================================== the run state's face
    def read_progress(self) -> TrainingProgress:
        """The live training counters (the checkpoint halves' only view of the trainer)."""
        return self.state.read_progress()

    def rollout_parts(self) -> RolloutParts:
        """The parts both rollout-checkpointing halves read (the run state's, filled in
        place by a restore)."""
        return self.state.parts

    @property
    def checkpointer(self) -> TrainerCheckpointer | None:
        return self.checkpoints.checkpointer

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def data_plane(self) -> DataPlane:
        return self.state.data_plane

    @property
    def barrier(self) -> DataPlaneBarrier:
        return self.state.barrier

    @property
    def buffer(self) -> ReplayBuffer:
        return self.state.buffer

    @property
    def dataloader(self) -> PromptDataloader:
        return self.state.dataloader

    @property
    def sampler(self) -> InOrderSampler:
        return self.state.sampler

    @property
    def ledger(self) -> RecoveryLedger | None:
        return self.state.ledger

    @property
    def runtime_state(self) -> RolloutRuntimeState:
        return self.state.runtime_state

    @property
    def resume(self) -> ResumeSource:
        return self.state.resume

    @property
    def trainer_version(self) -> int:
        return self.state.trainer_version

    @property
    def served_version(self) -> int:
        return self.state.served_version

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.history

    @property
    def groups_trained(self) -> list[str]:
        return self.state.groups_trained

    @property
    def trained_prompt_ids(self) -> list[int]:
        return self.state.trained_prompt_ids

    @property
    def max_observed_age(self) -> int:
        return self.state.max_observed_age


async def forced_snapshot(
    attempt: Callable[[], Awaitable[SnapshotOutcome]], deadline: float
) -> SnapshotOutcome | None:
    """A forced snapshot's outcome before ``deadline`` (``time.monotonic``); one that met an
    optimizer commit is tried again, any other outcome is final; None when time ran out."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            outcome = await asyncio.wait_for(attempt(), left)
        except TimeoutError:
            break
        if outcome is not SnapshotOutcome.SKIPPED_COMMIT_WINDOW:
            return outcome
        await asyncio.sleep(COMMIT_WINDOW_RETRY_S)
    logger.error("preemption snapshot did not publish within the grace period")
    return None

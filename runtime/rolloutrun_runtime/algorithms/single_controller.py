"""The single controller: a rollout pump and a train pump running GRPO side by side.

Why two pumps: rollouts (multi-turn, through Gym servers) and optimizer steps take very
different times, so the controller runs them concurrently and lets them meet only through
shared state: the replay buffer (sealed groups, one capacity permit each), the sampler's
target-step stamps (bounded staleness), the data plane (rows) and the recovery ledger. The
pumps never call each other.

Rollout pump: wait until the sampler admits the next step and a permit per prompt is free;
in one ``prompt_reservations`` mutation advance the dataloader, stamp the target step and
reserve one ledger group per prompt; each group then dispatches its siblings to Gym
replicas, stages every result in the data plane, and is finalized into ``train`` rows and
the replay buffer under one ``group_commits`` cut. A group with no learning signal (or one
that ran out of attempts) is replaced from the spare-prompt pool, or counted as shortfall.

With ``checkpointing.deterministic`` those decisions must not depend on finishing order: the
same cut also sets aside the step's spare reserve (one prompt per slot, slot ``i`` being the
``i``-th prompt of the reservation), and a dropped group is replaced by its own slot's
reserve prompt, or given up only when its slot is among the first
``int(P * (1 - minStepBatchFraction))`` (``decide_slot_drop``). Unused reserve prompts are
handed on to later steps once their step commits; the dataloader is drawn from nowhere else.

Train pump: wait for the groups stamped with its step (or the step's shortfall), compute
group-normalized advantages and the PPO-clip loss in one batched pass, then apply the
optimizer step and clear the rows inside one ``sample_clears`` mutation (the
optimizer-commit window), refit the generation workers and save a trainer checkpoint every
``savePeriod`` steps.

Checkpoint seams for the rollout-checkpointing package: ``RolloutParts`` (built once by
``rollout_parts``), the save lock shared by trainer checkpoints and snapshots, the
``optimizer_commit_in_progress`` flag read through ``read_progress``, and capture under
``barrier.checkpoint()`` (``capture_trainer_state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rolloutrun_runtime.algorithms.grpo import (
    accumulate_policy_gradients,
    batch_age,
    count_versions,
    zero_variance,
)
from rolloutrun_runtime.algorithms.gym_client import (
    GymCallError,
    GymClient,
    GymOutageError,
    GymReplica,
    GymUnavailableError,
    rollout_seed,
)
from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer, ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import (
    RestoredRolloutState,
    RolloutRestorer,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    DATA_PLANE_PREFIX,
    LEDGER_FILE,
    RUNTIME_STATE_FILE,
    CapturedRolloutState,
    CaptureKind,
    FinalizerResult,
    JournalGroup,
    ResumeSource,
    RolloutParts,
    RolloutRuntimeState,
    TrainedStep,
    TrainingProgress,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.algorithms.samplers import (
    InOrderSampler,
    PromptDataloader,
    newest_trained_at_admission,
)
from rolloutrun_runtime.algorithms.trainer_checkpoint import (
    CheckpointClashError,
    TrainerCapture,
    TrainerCheckpointer,
    restore_rng,
)
from rolloutrun_runtime.contract.run_config import RunConfig, TargetLevel
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.data_plane import DataPlane, DataPlaneBarrier
from rolloutrun_runtime.environments.checkpointing import EnvironmentCheckpoint
from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    EnvironmentEpisode,
    Granularity,
    GroupStatus,
    LiveCut,
    PromptRef,
    RecoveryLedger,
    RestoreLevel,
    new_attempt,
    new_uuid_hex,
)
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.workers import PolicyWorkers

logger = logging.getLogger(__name__)

#: Most dropped groups of one step that are replaced from the spare pool, per prompt (in
#: deterministic mode: the reserve prompts each slot gets).
REPLACEMENTS_PER_PROMPT = 1
#: Rows per forward pass in a train step (larger steps are split, the loss normalized once).
MICRO_BATCH_ROWS = 512
#: Gradient-norm clip for the optimizer step.
MAX_GRAD_NORM = 1.0

__all__ = ["DATA_PLANE_PREFIX", "LEDGER_FILE", "RUNTIME_STATE_FILE", "SingleController"]


class _GroupGivenUp(Exception):
    """A sibling ran out of attempts; the whole group is given up."""


class DropAction(enum.StrEnum):
    REPLACE = "replace"
    SHORTFALL = "shortfall"
    KEEP = "keep"


def decide_drop(
    *,
    failed: bool,
    replacements: int,
    shortfall: int,
    prompts_per_step: int,
    min_step_batch_fraction: float,
) -> DropAction:
    """What to do with a group that has no learning signal (or failed) for its step.

    Replace it from the spare pool while the step's replacement budget lasts; then give it
    up as shortfall while the step stays above ``minStepBatchFraction``; a group with zero
    variance past that is kept (it trains with zero advantage), a failed one is given up.
    """
    if replacements < REPLACEMENTS_PER_PROMPT * prompts_per_step:
        return DropAction.REPLACE
    max_shortfall = int(prompts_per_step * (1.0 - min_step_batch_fraction))
    if failed or shortfall < max_shortfall:
        return DropAction.SHORTFALL
    return DropAction.KEEP


def shortfall_slots(prompts_per_step: int, min_step_batch_fraction: float) -> int:
    """How many of a step's slots may close short (the first ones, in deterministic mode)."""
    return int(prompts_per_step * (1.0 - min_step_batch_fraction))


def decide_slot_drop(
    *,
    failed: bool,
    slot: int,
    reserve_left: bool,
    prompts_per_step: int,
    min_step_batch_fraction: float,
) -> DropAction:
    """Deterministic mode: what to do with a dropped group of slot ``slot``.

    A function of the slot alone, never of how many groups of the step dropped before it: a
    failed group (attempts exhausted: environmental, outside what bit-identity promises) is
    given up; a zero-variance one is replaced by its slot's reserve prompt while one is
    left, then given up when its slot is one of the first ``shortfall_slots`` (so at least
    ``minStepBatchFraction`` of the step's groups train), else kept with zero advantage.
    """
    if not 0 <= slot < prompts_per_step:
        raise ValueError(f"slot {slot} is outside a step of {prompts_per_step} prompts")
    if failed:
        return DropAction.SHORTFALL
    if reserve_left:
        return DropAction.REPLACE
    if slot < shortfall_slots(prompts_per_step, min_step_batch_fraction):
        return DropAction.SHORTFALL
    return DropAction.KEEP


@dataclass
class _GroupRun:
    """A group being generated (the in-memory side of a ledger group)."""

    group_id: str
    prompt: PromptRef
    target_step: int
    start_version: int
    staged: dict[int, str] = field(default_factory=dict)
    slot: int | None = None
    """Deterministic mode: the step slot the group fills (None: decided as asynchronous)."""


class ControllerError(RuntimeError):
    """The controller cannot continue (a pump failed, a restore does not fit)."""


@dataclass
class _StepCounters:
    """Per stamped step: why its groups were given up (for the error when none is left)."""

    given_up: list[str] = field(default_factory=list)


@dataclass
class _Selected:
    step: int
    groups: list[ReplayGroup]
    rows: list[dict[str, Any]]
    results: list[FinalizerResult] = field(default_factory=list)
    rollout_rewards: list[float] = field(default_factory=list)
    """Every rollout of the step's finalized or dropped groups (taken at the commit)."""


@contextlib.asynccontextmanager
async def _no_cut() -> AsyncIterator[None]:
    yield None


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
        on_step: Callable[[dict[str, Any]], None] | None = None,
        pad_id: int = 0,
        trace: TraceWriter | None = None,
        manifests: ManifestStore | None = None,
        environment: EnvironmentCheckpoint | None = None,
        fence: Callable[[], None] | None = None,
        on_published: Callable[[dict[str, Any]], None] | None = None,
        on_snapshot: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if cfg.rollout.replay_capacity < cfg.grpo.prompts_per_step:
            raise ControllerError(
                f"rollout.replayCapacity ({cfg.rollout.replay_capacity}) must be at least "
                f"grpo.promptsPerStep ({cfg.grpo.prompts_per_step}): a step could never fill"
            )
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.workers = workers
        self.checkpointer = checkpointer
        self.on_step = on_step
        self.pad_id = pad_id
        self.trace = trace if trace is not None else TraceWriter(None)
        self.manifests = manifests
        self.environment = environment
        self._fence = fence
        self._on_published = on_published
        self._on_snapshot = on_snapshot
        self.device = next(model.parameters()).device
        self.overhead = OverheadClock()
        self.gym = GymClient(
            gym_endpoints,
            timeout_s=cfg.rollout.rollout_timeout_seconds,
            max_seq_len=cfg.policy.max_seq_len,
            overhead=self.overhead,
            unreachable_budget_s=cfg.rollout.gym_unreachable_seconds,
        )

        grpo = cfg.grpo
        self.data_plane = DataPlane()
        self.barrier = DataPlaneBarrier()
        self.buffer = ReplayBuffer(cfg.rollout.replay_capacity)
        self.dataloader = PromptDataloader(cfg.task.dataset_size, cfg.seed)
        self.sampler = InOrderSampler(grpo.prompts_per_step, grpo.max_staleness, grpo.max_steps)
        self.ledger: RecoveryLedger | None = RecoveryLedger() if cfg.uses_ledger else None
        self._rollout_runtime = RolloutRuntimeState()
        self._save_lock = asyncio.Lock()
        self.resume = ResumeSource()

        level = cfg.checkpointing.target_level
        self._granularity = (
            Granularity.PROMPT_GROUP if level is TargetLevel.PROMPT_GROUP else Granularity.SIBLING
        )
        self._restore_level = {
            TargetLevel.TURN: RestoreLevel.TURN,
            TargetLevel.PROMPT_GROUP: RestoreLevel.PROMPT_GROUP,
        }.get(level, RestoreLevel.SIBLING)

        self.trainer_version = 0
        # The version the generation workers serve: admission and pinning must use it, not
        # the trainer's, or tokens generated between a commit and its refit look younger.
        self.served_version = 0
        self._optimizer_commit_in_progress = False
        self._durable_step: int | None = None
        self._progress_changed = asyncio.Event()
        self._in_flight = asyncio.Semaphore(cfg.rollout.max_in_flight_groups)
        self._tasks: set[asyncio.Task[None]] = set()
        self._fatal: BaseException | None = None
        self._next_policy = 0
        self._deferred: tuple[int, asyncio.Task[dict[str, bytes]]] | None = None

        self._step_counters: dict[int, _StepCounters] = defaultdict(_StepCounters)
        self._generated_tokens = 0
        self.groups_trained: list[str] = []
        self.trained_prompt_ids: list[int] = []
        self.history: list[dict[str, Any]] = []
        self.max_observed_age = 0
        self._restored_episodes: dict[str, str] = {}
        #: The environment's restore scope: open from restore() until the ledger accepted it.
        self._environment_restore = contextlib.AsyncExitStack()
        self._restored_from: RestoredRolloutState | None = None
        self.rollout_restorer = RolloutRestorer(
            cfg,
            manifests=manifests,
            checkpointer=checkpointer,
            environment=environment,
            trace=self.trace,
        )
        self.rollout_snapshots = self._build_snapshotter()

    def _build_snapshotter(self) -> RolloutSnapshotter:
        """The snapshot half, over the current parts (rebuilt after a restore swaps them)."""
        checkpointer = self.checkpointer
        return RolloutSnapshotter(
            self.rollout_parts(),
            manifests=self.manifests,
            anchor_is_durable=checkpointer.is_durable if checkpointer is not None else None,
            environment=self.environment,
            trace=self.trace,
            fence=self._fence,
            on_published=self._on_published,
            on_record=self._on_snapshot,
        )

    # ================================================================== shared parts
    def read_progress(self) -> TrainingProgress:
        """The live training counters (the checkpoint halves' only view of the trainer)."""
        return TrainingProgress(
            trainer_version=self.trainer_version,
            optimizer_commit_in_progress=self._optimizer_commit_in_progress,
            durable_step=self._durable_step,
            max_steps=self.cfg.grpo.max_steps,
        )

    def rollout_parts(self) -> RolloutParts:
        """The parts both rollout-checkpointing halves read."""
        return RolloutParts(
            config=self.cfg,
            data_plane=self.data_plane,
            barrier=self.barrier,
            buffer=self.buffer,
            dataloader=self.dataloader,
            sampler=self.sampler,
            ledger=self.ledger,
            runtime_state=self._rollout_runtime,
            save_lock=self._save_lock,
            read_progress=self.read_progress,
            log_metrics=lambda metrics: logger.debug("rollout metrics %s", dict(metrics)),
        )

    @property
    def runtime_state(self) -> RolloutRuntimeState:
        return self._rollout_runtime

    # ================================================================== run
    async def run(self) -> list[dict[str, Any]]:
        """Run both pumps until ``maxSteps`` steps are trained; returns the step records."""
        if self.manifests is not None:
            await asyncio.to_thread(self.rollout_snapshots.ensure_bootstrap_anchor)
        await self.gym.open()
        try:
            await self._relaunch_restored()
            rollout = asyncio.create_task(self._rollout_pump(), name="rollout-pump")
            train = asyncio.create_task(self._train_pump(), name="train-pump")
            snapshots = asyncio.create_task(
                self.rollout_snapshots.run_pump(
                    self.cfg.checkpointing.snapshot_interval_seconds,
                    self.cfg.checkpointing.snapshot_every_steps,
                ),
                name="snapshot-pump",
            )
            try:
                pending = {rollout, train, snapshots}
                while not train.done():
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()
            finally:
                for task in (rollout, train, snapshots, *self._tasks):
                    task.cancel()
                await asyncio.gather(
                    rollout, train, snapshots, *self._tasks, return_exceptions=True
                )
            await self.finalize_deferred_checkpoint()
            if self.checkpointer is not None and self._durable_step != self.trainer_version:
                # The run always ends with a trainer checkpoint at maxSteps.
                await self.trainer_checkpoint(defer=False)
        finally:
            await self.gym.close()
        return self.history

    async def preemption_snapshot(self, grace_s: float) -> str:
        """SIGTERM: force a snapshot that publishes within ``grace_s``; returns its outcome."""
        deadline = time.time() + grace_s
        self.trace.emit("preemption_notice", deadline=deadline)
        if self.manifests is None:
            return "no_storage"
        try:
            outcome = await asyncio.wait_for(
                self.rollout_snapshots.attempt(force=True, reason="preemption"), grace_s
            )
        except TimeoutError:
            logger.error("preemption snapshot did not publish within %.1fs", grace_s)
            return "timed_out"
        return outcome.value

    def _launch(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self._fatal is None:
            logger.error("rollout task %s failed", task.get_name(), exc_info=error)
            self._fatal = error
            self._progress_changed.set()

    def _signal(self) -> None:
        self._progress_changed.set()

    async def _wait_for(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self._fatal is not None:
                raise ControllerError(f"a rollout task failed: {self._fatal}") from self._fatal
            self._progress_changed.clear()
            if ready():
                return
            await self._progress_changed.wait()

    # ================================================================== the four dispatch methods
    def _dispatch_reservation(self, kind: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """A mutation slot counted as ``kind`` with ledger dispatch; nothing without it."""
        if self.ledger is not None:
            return self.barrier.mutation(kind)
        return _no_cut()

    def _reserve_prompt_group(
        self, cut: LiveCut | None, prompt: PromptRef, step: int, slot: int | None = None
    ) -> _GroupRun:
        group_id = f"pg{new_uuid_hex()[:12]}"
        if self.ledger is not None:
            assert cut is not None
            self.ledger.reserve_group(
                cut,
                group_id=group_id,
                admission_id=f"step{step}",
                prompt=prompt,
                target_step=step,
                start_weight_version=self.served_version,
                group_size=self.cfg.grpo.group_size,
                granularity=self._granularity,
                restore_level=self._restore_level,
            )
            self.ledger.admit(cut, group_id)
            self.trace.emit(
                "group_reserved",
                group_id=group_id,
                prompt_id=prompt.prompt_id,
                epoch=prompt.epoch,
                target_step=step,
            )
        return _GroupRun(group_id, prompt, step, self.served_version, slot=slot)

    def _discard_prompt_group(self, cut: LiveCut | None, group_id: str, reason: str) -> None:
        if self.ledger is not None:
            assert cut is not None
            self.ledger.discard(cut, group_id, reason)

    def _admit_step(self, cut: LiveCut | None) -> int:
        """Stamp the next target step: inside the reservation cut with ledger dispatch."""
        if cut is not None:
            cut.require_live()
        return self.sampler.admit(self.served_version)

    # ================================================================== rollout pump
    async def _rollout_pump(self) -> None:
        prompts = self.cfg.grpo.prompts_per_step
        while True:
            await self._wait_for(
                lambda: self.sampler.exhausted or self.sampler.admissible(self.served_version)
            )
            if self.sampler.exhausted:
                return
            for _ in range(prompts):
                await self.buffer.acquire_permit()
            async with self._dispatch_reservation("prompt_reservations") as cut:
                with self.overhead:
                    if self.cfg.checkpointing.deterministic:
                        refs = self.dataloader.next_prompts(prompts)
                        step = self._admit_step(cut)
                        self._reserve_spares(step, refs)
                        crash_point("after_dataloader_advance")
                        slots: list[int | None] = list(range(prompts))
                    else:
                        self._refill_spare_pool()
                        refs = self.dataloader.next_prompts(prompts)
                        crash_point("after_dataloader_advance")
                        step = self._admit_step(cut)
                        slots = [None] * prompts
                    runs = [
                        self._reserve_prompt_group(cut, ref, step, slot)
                        for ref, slot in zip(refs, slots, strict=True)
                    ]
            for run in runs:
                self._launch(self._run_group(run), run.group_id)

    def _reserve_spares(self, step: int, refs: list[PromptRef]) -> None:
        """Deterministic mode: record ``step``'s slots and set aside its reserve, one prompt
        per slot and replacement (none without zero-variance drops: a failed group is never
        replaced in deterministic mode, so the dataloader draws only the step's prompts)."""
        per_slot = REPLACEMENTS_PER_PROMPT if self.cfg.grpo.drop_zero_variance_groups else 0
        self._rollout_runtime.reserve_step(
            step,
            refs,
            per_slot * len(refs),
            newest_trained=newest_trained_at_admission(step, self.cfg.grpo.max_staleness),
            draw=self.dataloader.next_prompts,
        )

    def _refill_spare_pool(self) -> None:
        pool = self._rollout_runtime.spare_prompts
        missing = self.cfg.rollout.spare_low_water - len(pool)
        if missing > 0:
            pool.extend(self.dataloader.next_prompts(missing))

    def _take_spare(self) -> PromptRef:
        pool = self._rollout_runtime.spare_prompts
        if not pool:
            pool.extend(self.dataloader.next_prompts(max(1, self.cfg.rollout.spare_low_water)))
        return pool.pop(0)

    async def _run_group(self, run: _GroupRun) -> None:
        reason: str | None = None
        try:
            async with self._in_flight:
                if self.cfg.checkpointing.deterministic:
                    await self._wait_for(lambda: self.served_version >= run.target_step - 1)
                async with asyncio.TaskGroup() as siblings:
                    for index in range(self.cfg.grpo.group_size):
                        if index not in run.staged:
                            siblings.create_task(self._run_sibling(run, index))
        except* _GroupGivenUp as given_up:
            reason = f"attempts exhausted: {given_up.exceptions[0]}"
        except* GymOutageError as outage:
            raise outage.exceptions[0] from None  # the member loss, named, stops the trainer
        if reason is not None:
            await self._drop_group(run, reason, failed=True)
        else:
            await self._finalize_group(run)

    def _policy_url(self) -> str:
        endpoints = self.workers.endpoints
        url = endpoints[self._next_policy % len(endpoints)]
        self._next_policy += 1
        return url

    async def _run_sibling(self, run: _GroupRun, index: int) -> None:
        sibling_id = f"{run.group_id}_g{index}"
        local_attempt = new_attempt(sibling_id) if self.ledger is None else None
        failures = 0
        unreachable_tries = 0
        while True:
            async with self._dispatch_reservation("rollout_dispatch") as cut:
                if self.ledger is not None:
                    attempt = self.ledger.sibling(sibling_id).current
                    owner = attempt.gym_instance_id if attempt.gym_attempt > 0 else None
                    replica = self.gym.pick(owner)
                    self.ledger.dispatch(cut, sibling_id, attempt.attempt_uuid, replica.instance_id)
                    self._trace_attempt(
                        "attempt_dispatched",
                        run,
                        index,
                        attempt.attempt_uuid,
                        gym_instance_id=replica.instance_id,
                        gym_attempt=attempt.gym_attempt,
                    )
                else:
                    assert local_attempt is not None
                    attempt = local_attempt
                    replica = self.gym.pick(None)
            try:
                row = await self._call_gym(replica, run, index, attempt.episode)
            except GymUnavailableError as error:
                # Infrastructure, not a sample: no attempt of maxAttempts is spent; the sibling
                # stays pending under a new attempt after a backoff (GymOutageError past the
                # budget). A new attempt, because the lost replica may have started the old one.
                spent = self.gym.outages.unreachable(replica.url, error)
                unreachable_tries += 1
                delay = self.gym.backoff(unreachable_tries)
                logger.log(
                    logging.WARNING if unreachable_tries == 1 else logging.DEBUG,
                    "rollout %s: %s (unreachable for %.1fs); retrying in %.2fs",
                    attempt.rollout_id,
                    error,
                    spent,
                    delay,
                )
                async with self._dispatch_reservation("rollout_failures") as cut:
                    if self.ledger is not None:
                        self.ledger.abandon(cut, sibling_id, attempt.attempt_uuid, str(error))
                        self._trace_attempt(
                            "attempt_abandoned",
                            run,
                            index,
                            attempt.attempt_uuid,
                            reason="gym_unreachable",
                        )
                        self.ledger.retry(cut, sibling_id)
                    else:
                        local_attempt = new_attempt(sibling_id)
                await asyncio.sleep(delay)
                continue
            except GymCallError as error:
                failures += 1
                if self.ledger is not None:  # attempts failed before a restart count too
                    failures = self.ledger.sibling(sibling_id).failed_attempts + 1
                exhausted = failures >= self.cfg.rollout.max_attempts
                logger.warning(
                    "rollout %s attempt failed (%d/%d): %s",
                    attempt.rollout_id,
                    failures,
                    self.cfg.rollout.max_attempts,
                    error,
                )
                async with self._dispatch_reservation("rollout_failures") as cut:
                    if self.ledger is not None:
                        self.ledger.fail(cut, sibling_id, attempt.attempt_uuid, str(error))
                        self._trace_attempt(
                            "attempt_failed", run, index, attempt.attempt_uuid, reason=str(error)
                        )
                        if not exhausted:
                            self.ledger.retry(cut, sibling_id)
                    else:
                        local_attempt = new_attempt(sibling_id)
                if exhausted:
                    raise _GroupGivenUp(f"{sibling_id}: {error}") from error
                continue
            key = attempt.episode.capture_key
            async with self.barrier.mutation("rollout_seals") as cut:
                with self.overhead:
                    self.data_plane.put("staging", key, row)
                    run.staged[index] = key
                    if self.ledger is not None:
                        self.ledger.seal(
                            cut, sibling_id, attempt.attempt_uuid, reward=row["reward"], row_key=key
                        )
                        self._trace_attempt("attempt_sealed", run, index, attempt.attempt_uuid)
            return

    def _trace_attempt(
        self, event: str, run: _GroupRun, index: int, attempt_uuid: str, **fields: Any
    ) -> None:
        self.trace.emit(
            event,
            group_id=run.group_id,
            prompt_id=run.prompt.prompt_id,
            epoch=run.prompt.epoch,
            generation_index=index,
            attempt_uuid=attempt_uuid,
            **fields,
        )

    async def _call_gym(
        self, replica: GymReplica, run: _GroupRun, index: int, episode: EnvironmentEpisode
    ) -> dict[str, Any]:
        deterministic = self.cfg.checkpointing.deterministic
        sampling = {
            "temperature": self.cfg.policy.temperature,
            "max_new_tokens": self.cfg.task.max_new_tokens,
            "seed": rollout_seed(self.cfg.seed, run.prompt, index),
            "weight_version": run.target_step - 1 if deterministic else None,
        }
        row = await self.gym.run_episode(
            replica, episode, run.prompt.prompt_id, self._policy_url(), sampling
        )
        self._generated_tokens += row["model_tokens"]
        return row

    async def _finalize_group(self, run: _GroupRun) -> None:
        keys = [run.staged[i] for i in range(self.cfg.grpo.group_size)]
        rows = self.data_plane.get_many("staging", keys)
        rewards = [float(row["reward"]) for row in rows]
        if (
            self.cfg.grpo.drop_zero_variance_groups
            and zero_variance(rewards)
            and self._decide_drop(run, failed=False) is not DropAction.KEEP
        ):
            await self._drop_group(run, "zero reward variance", failed=False)
            return
        async with self.barrier.mutation("group_commits") as cut:
            with self.overhead:
                if self.ledger is not None:
                    self.ledger.begin_finalize(cut, run.group_id)
                crash_point("inside_finalize_commit")
                try:
                    row_keys = []
                    tokens_by_version: dict[int, int] = defaultdict(int)
                    model_tokens = 0
                    for index, row in enumerate(rows):
                        row_key = f"{run.group_id}_g{index}"
                        train_row = dict(row)
                        train_row["prompt_id"] = run.prompt.prompt_id
                        train_row["target_step"] = run.target_step
                        train_row["epoch"] = run.prompt.epoch
                        self.data_plane.put("train", row_key, train_row)
                        row_keys.append(row_key)
                        model_tokens += int(row["model_tokens"])
                        versions = count_versions(
                            np.asarray(row["weight_versions"]), np.asarray(row["loss_mask"])
                        )
                        for version, count in versions.items():
                            tokens_by_version[version] += count
                    self.data_plane.clear("staging", keys)
                    if self.ledger is not None:
                        self.ledger.finish_finalize(cut, run.group_id)
                        self.trace.emit(
                            "group_sealed",
                            group_id=run.group_id,
                            prompt_id=run.prompt.prompt_id,
                            epoch=run.prompt.epoch,
                        )
                    self.buffer.add(
                        ReplayGroup(
                            group_id=run.group_id,
                            prompt_id=run.prompt.prompt_id,
                            target_step=run.target_step,
                            row_keys=tuple(row_keys),
                            rewards=tuple(rewards),
                            model_tokens=model_tokens,
                        )
                    )
                    self._record_rewards(run.target_step, rewards)
                    self._rollout_runtime.finalizer_results[run.group_id] = FinalizerResult(
                        group_id=run.group_id,
                        target_step=run.target_step,
                        rewards=rewards,
                        model_tokens=model_tokens,
                        tokens_by_version=dict(tokens_by_version),
                    )
                except Exception:
                    if self.ledger is not None:
                        self.ledger.finalization_unknown(cut, run.group_id)
                    raise
        self._signal()

    def _record_rewards(self, step: int, rewards: list[float]) -> None:
        """Count a finalized or dropped group's rollouts toward its step's ``reward_mean``
        (call inside the mutation that finalizes or drops it: a cut saves them with it)."""
        if step > self.trainer_version:
            self._rollout_runtime.step_rewards.setdefault(step, []).extend(rewards)

    def _decide_drop(self, run: _GroupRun, *, failed: bool) -> DropAction:
        """The drop decision: slot-bound for a deterministic step with a reserve, else by
        the step's budgets (asynchronous mode, or a step admitted before a resume from a
        checkpoint that kept no reserves)."""
        state = self._rollout_runtime
        grpo = self.cfg.grpo
        record = state.step_reserves.get(run.target_step)
        if run.slot is not None and record is not None:
            return decide_slot_drop(
                failed=failed,
                slot=run.slot,
                reserve_left=record.next_unused(run.slot) is not None,
                prompts_per_step=grpo.prompts_per_step,
                min_step_batch_fraction=grpo.min_step_batch_fraction,
            )
        return decide_drop(
            failed=failed,
            replacements=state.replacements.get(run.target_step, 0),
            shortfall=state.shortfall(run.target_step),
            prompts_per_step=grpo.prompts_per_step,
            min_step_batch_fraction=grpo.min_step_batch_fraction,
        )

    def _replacement_prompt(self, run: _GroupRun) -> PromptRef:
        """The prompt that replaces ``run``: its slot's next reserve prompt (marked used),
        else the spare pool's next one (call under the discard mutation)."""
        record = self._rollout_runtime.step_reserves.get(run.target_step)
        if run.slot is not None and record is not None:
            position = record.next_unused(run.slot)
            if position is None:
                raise ControllerError(
                    f"slot {run.slot} of step {run.target_step} has no reserve prompt left"
                )
            record.used[position] = True
            return record.reserve[position]
        return self._take_spare()

    async def _drop_group(self, run: _GroupRun, reason: str, *, failed: bool) -> None:
        """Give a group up: replace it (keeping its permit) or count it as shortfall."""
        state = self._rollout_runtime
        step = run.target_step
        action = self._decide_drop(run, failed=failed)
        if action is DropAction.KEEP:
            action = DropAction.SHORTFALL
        replacement: _GroupRun | None = None
        async with self.barrier.mutation("group_discards") as cut:
            with self.overhead:
                staged = [k for k in run.staged.values() if self.data_plane.contains("staging", k)]
                rows = self.data_plane.get_many("staging", staged)
                self._record_rewards(step, [float(row["reward"]) for row in rows])
                self.data_plane.clear("staging", run.staged.values())
                self._discard_prompt_group(cut, run.group_id, reason)
                state.pending_drops.append(run.prompt)
                if self.ledger is not None:
                    self.trace.emit(
                        "group_dropped",
                        group_id=run.group_id,
                        prompt_id=run.prompt.prompt_id,
                        reason=reason,
                    )
                if action is DropAction.REPLACE:
                    state.replacements[step] = state.replacements.get(step, 0) + 1
                    replacement = self._reserve_prompt_group(
                        cut, self._replacement_prompt(run), step, run.slot
                    )
                else:
                    state.batch_shortfall[step] = state.shortfall(step) + 1
                    self.buffer.release_permit()
                    if failed:
                        self._step_counters[step].given_up.append(f"{run.group_id}: {reason}")
        logger.debug("group %s for step %d dropped (%s): %s", run.group_id, step, reason, action)
        if replacement is not None:
            self._launch(self._run_group(replacement), replacement.group_id)
        self._signal()

    # ================================================================== train pump
    async def _train_pump(self) -> None:
        last = time.perf_counter()
        self.overhead.take()
        env_mark, tokens_mark = self.gym.env_seconds, self._generated_tokens
        while self.trainer_version < self.cfg.grpo.max_steps:
            step = self.trainer_version + 1
            selected = await self._select_groups(step)
            compute_started = time.perf_counter()
            stats = await asyncio.to_thread(self._compute_gradients, selected)
            loss_compute_s = time.perf_counter() - compute_started
            await self._commit_step(selected)
            refit_started = time.perf_counter()
            await self.workers.refit(self._weights_for_refit(), self.trainer_version)
            self.served_version = self.trainer_version
            self._signal()
            refit_s = time.perf_counter() - refit_started
            now = time.perf_counter()
            step_time = now - last
            last = now
            record = self._step_record(
                selected,
                stats,
                step_time=step_time,
                compute_s=loss_compute_s,
                refit_s=refit_s,
                tokens=self._generated_tokens - tokens_mark,
                env_s=self.gym.env_seconds - env_mark,
            )
            env_mark, tokens_mark = self.gym.env_seconds, self._generated_tokens
            self.history.append(record)
            self.trace.emit(
                "step_completed",
                step=record["step"],
                weight_version=self.trainer_version,
                groups=record["groups"],
                batch_age=record["batch_age"],
            )
            if self.on_step is not None:
                self.on_step(record)
            await self.finalize_deferred_checkpoint()
            if self.checkpointer is not None and step % self.cfg.checkpointing.save_period == 0:
                await self.trainer_checkpoint()
            self.rollout_snapshots.train_step_completed(
                self.trainer_version, self.cfg.checkpointing.snapshot_every_steps
            )

    async def _select_groups(self, step: int) -> _Selected:
        prompts = self.cfg.grpo.prompts_per_step

        def ready() -> bool:
            have = len(self.buffer.ready_for(step))
            return have + self._rollout_runtime.shortfall(step) >= prompts

        await self._wait_for(ready)
        if not self.buffer.ready_for(step):
            # Never an optimizer step over nothing recorded as reward 0 / loss 0: every group
            # of the step failed as a sample (infrastructure never gives a group up).
            reasons = self._step_counters[step].given_up
            raise ControllerError(
                f"step {step} has no group to train: all {prompts} were given up"
                + (f" (last: {reasons[-1]})" if reasons else "")
            )
        async with self.barrier.mutation("group_removals") as cut:
            with self.overhead:
                stale = self.buffer.stale_before(step)
                if stale:
                    logger.warning("evicting %d stale groups before step %d", len(stale), step)
                    self.buffer.take([g.group_id for g in stale])
                    for group in stale:
                        self._rollout_runtime.pending_drops.append(self._prompt_of(group))
                        self.data_plane.clear("train", group.row_keys)
                        self._discard_prompt_group(cut, group.group_id, "stale")
                    self.buffer.release_permit(len(stale))
                chosen = self.buffer.ready_for(step)
                if self.cfg.checkpointing.deterministic:
                    # Finalization order is timing; the trained order must not be.
                    chosen = sorted(chosen, key=self._deterministic_order)
                chosen = chosen[:prompts]
                ids = [g.group_id for g in chosen]
                self.buffer.take(ids)
                if self.ledger is not None:
                    self.ledger.claim(cut, ids, step)
                self._rollout_runtime.open_step_groups = list(chosen)
                rows = [
                    row for g in chosen for row in self.data_plane.get_many("train", g.row_keys)
                ]
        return _Selected(step, chosen, rows)

    def _deterministic_order(self, group: ReplayGroup) -> tuple[int, int]:
        """A timing-free sort key: the group's prompt, ``(prompt_id, epoch)``.

        An epoch draws each prompt once and a step's groups are distinct drawn prompts (its
        slots' own or their reserve prompts), so no two groups of a step share a key: no tie
        is left for the random group ids to break.
        """
        prompt = self._prompt_of(group)
        return (prompt.prompt_id, prompt.epoch)

    def _compute_gradients(self, selected: _Selected) -> dict[str, float]:
        """Forward, PPO-clip loss and backward over the step's rows (runs in a thread)."""
        self.optimizer.zero_grad(set_to_none=True)
        if not selected.rows:
            return {"loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0}
        stats = accumulate_policy_gradients(
            self.model,
            selected.rows,
            [g.rewards for g in selected.groups],
            pad_id=self.pad_id,
            temperature=self.cfg.policy.temperature,
            clip_epsilon=self.cfg.grpo.clip_epsilon,
            micro_batch_rows=MICRO_BATCH_ROWS,
        )
        stats["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        )
        return stats

    async def _commit_step(self, selected: _Selected) -> None:
        """The optimizer-commit window: apply the step and clear its rows in one mutation."""
        step = selected.step
        ids = [g.group_id for g in selected.groups]
        self._optimizer_commit_in_progress = True
        try:
            async with self.barrier.mutation("sample_clears") as cut:
                crash_point("inside_optimizer_commit")
                if selected.groups:  # always, from the train pump (see ``_select_groups``)
                    self.optimizer.step()
                with self.overhead:
                    selected.rollout_rewards = self._rollout_runtime.step_rewards.pop(step, [])
                    self._journal_step(selected)
                    if self.manifests is None:
                        for group in selected.groups:
                            self.data_plane.clear("train", group.row_keys)
                    if self.ledger is not None:
                        self.ledger.remove_trained(cut, ids, step)
                    self.buffer.release_permit(len(ids))
                    self._rollout_runtime.open_step_groups = []
                    self._rollout_runtime.commit_reserve(step)
                    self.trainer_version = step
                    self.groups_trained.extend(ids)
                    for group in selected.groups:
                        result = self._rollout_runtime.finalizer_results.pop(group.group_id, None)
                        if result is None:
                            continue
                        selected.results.append(result)
                        self.trace.emit(
                            "group_trained",
                            group_id=group.group_id,
                            prompt_id=group.prompt_id,
                            step=step,
                            tokens_by_version=result.tokens_by_version,
                        )
                    self.trained_prompt_ids.extend(g.prompt_id for g in selected.groups)
        finally:
            self._optimizer_commit_in_progress = False
        self._signal()

    def _journal_step(self, selected: _Selected) -> None:
        """Record a committing step; with snapshots, keep its rows until a save covers it."""
        groups = tuple(
            JournalGroup(
                group_id=g.group_id,
                prompt_id=g.prompt_id,
                epoch=self._prompt_of(g).epoch,
                target_step=g.target_step,
            )
            for g in selected.groups
        )
        state = self._rollout_runtime
        keep = tuple(selected.groups) if self.manifests is not None else ()
        dropped, state.pending_drops = tuple(state.pending_drops), []
        state.journal.append(TrainedStep(selected.step, groups, keep, dropped))

    def _prompt_of(self, group: ReplayGroup) -> PromptRef:
        """A finalized group's prompt (its epoch is on its train rows)."""
        epoch = 0
        if group.row_keys:
            epoch = int(self.data_plane.get("train", group.row_keys[0]).get("epoch", 0))
        return PromptRef(group.prompt_id, epoch)

    def _retrain(self, entry: TrainedStep) -> None:
        """Retrain a journaled step from its kept rows (resume from an older anchor)."""
        groups = list(entry.row_groups)
        rows = [row for g in groups for row in self.data_plane.get_many("train", g.row_keys)]
        selected = _Selected(entry.step, groups, rows)
        self._compute_gradients(selected)
        if groups:
            self.optimizer.step()
        self.trainer_version = entry.step

    def _weights_for_refit(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def _step_record(
        self,
        selected: _Selected,
        stats: Mapping[str, float],
        *,
        step_time: float,
        compute_s: float,
        refit_s: float,
        tokens: int,
        env_s: float,
    ) -> dict[str, Any]:
        step = selected.step
        state = self._rollout_runtime
        versions: dict[int, int] = defaultdict(int)
        for result in selected.results:
            for version, count in result.tokens_by_version.items():
                versions[version] += count
        step_max_age = (step - 1) - min(versions) if versions else 0
        self.max_observed_age = max(self.max_observed_age, step_max_age)
        self._step_counters.pop(step, None)
        # Sorted: the mean must not depend on the order groups finished in.
        rewards = sorted(selected.rollout_rewards)
        trained_rewards = [r for g in selected.groups for r in g.rewards]
        overhead_s = self.overhead.take()
        record: dict[str, Any] = {
            "step": step,
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "trained_reward_mean": float(np.mean(trained_rewards)) if trained_rewards else 0.0,
            "loss": stats["loss"],
            "clip_fraction": stats["clip_fraction"],
            "approx_kl": stats["approx_kl"],
            "grad_norm": stats.get("grad_norm", 0.0),
            "step_time_s": step_time,
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "generated_tokens": tokens,
            "groups": len(selected.groups),
            "prompt_ids": [g.prompt_id for g in selected.groups],
            "shortfall": state.shortfall(step),
            "replacements": state.replacements.get(step, 0),
            "rollouts": len(rewards),
            "batch_age": batch_age(versions, step - 1),
            "max_token_age": step_max_age,
            "train_compute_s": compute_s,
            "refit_s": refit_s,
            "env_s": env_s,
            "controller_overhead_s": overhead_s,
            "controller_overhead_share": overhead_s / step_time if step_time > 0 else 0.0,
            "spare_prompts": len(state.spare_prompts),
            "reserved_prompts": len(state.reserved_prompts()),
            "replay_groups": len(self.buffer),
            "barrier_waits": {
                kind: round(stats_["total_s"], 6)
                for kind, stats_ in self.barrier.wait_telemetry().items()
            },
        }
        state.forget_step(step)
        return record

    # ================================================================== trainer checkpoints
    def capture_trainer_state(self, cut: LiveCut) -> tuple[TrainerCapture, CapturedRolloutState]:
        """In-memory copies of everything a trainer checkpoint saves (call under the cut)."""
        captured = self.rollout_snapshots.capture(cut, CaptureKind.TRAINER_CHECKPOINT)
        trainer_state: dict[str, Any] = {
            **captured.controller_state,
            "training_info": {
                "groups_trained": len(self.groups_trained),
                "last_step": self.history[-1] if self.history else None,
            },
        }
        capture = TrainerCapture.take(
            self.trainer_version, self.model, self.optimizer, trainer_state
        )
        return capture, captured

    async def trainer_checkpoint(self, *, defer: bool | None = None) -> None:
        """Save ``step_<N>`` for the current version (deferred finalize if configured)."""
        defer = self.cfg.checkpointing.defer_finalize if defer is None else defer
        async with self._save_lock:
            async with self.barrier.checkpoint() as cut:
                capture, captured = self.capture_trainer_state(cut)

            def serialize() -> dict[str, bytes]:
                # The sidecars first: they settle the ledger's checksum facts (computed after
                # the cut), which the trainer state records too.
                sidecars = RolloutSnapshotter.write_controller_sidecars(captured)
                if "rollout_recovery" in captured.controller_state:
                    capture.trainer_state["rollout_recovery"] = captured.controller_state[
                        "rollout_recovery"
                    ]
                files = capture.to_files()
                files.update(sidecars)
                return files

            task = asyncio.create_task(asyncio.to_thread(serialize))
            if defer:
                self._deferred = (capture.step, task)
                return
            await self._publish(capture.step, await task)

    async def _publish(self, step: int, files: dict[str, bytes]) -> None:
        """Commit ``step_<N>`` (fenced), then release the rows kept for replay up to N."""
        assert self.checkpointer is not None
        if self._fence is not None:
            self._fence()
        crash_point("during_trainer_checkpoint_finalize")
        try:
            uri = await asyncio.to_thread(self.checkpointer.publish_files, step, files)
        except CheckpointClashError as error:
            # Another trajectory's weights hold step_<N>: never anchor to them. The run goes
            # on anchored to its last own step (snapshots keep the groups since) and the next
            # trainer checkpoint anchors it again; see trainer_checkpoint.
            logger.error("trainer checkpoint not anchored: %s", error)
            return
        self._durable_step = step
        async with self.barrier.mutation("anchor_advances"):
            released = self._rollout_runtime.advance_replay_anchor(step)
            self.data_plane.clear("train", released)
        logger.debug("trainer checkpoint %s is durable", uri)
        # ``on_published`` reports snapshot manifests (the snapshotter calls it); the
        # checkpointer itself reports trainer anchors.
        self.rollout_snapshots.trainer_checkpoint_published(step)

    async def finalize_deferred_checkpoint(self) -> None:
        """Publish a deferred trainer checkpoint (at a step boundary, or at the end)."""
        if self._deferred is None:
            return
        step, task = self._deferred
        self._deferred = None
        async with self._save_lock:
            await self._publish(step, await task)

    # ================================================================== restore
    async def restore(self) -> RestoredRolloutState | None:
        """Resume from the best source (see ``RolloutRestorer``); None for a fresh run.

        Runs before ``run``: the restorer reads, verifies and decides the newest restorable
        entry first (a refused one is skipped, nothing of it installed; every one refused
        raises ``UnrestorableError``), then this installs it, retrains the steps a snapshot
        carries past its anchor, syncs the generation workers, and (turn level) hands copied
        episodes back to the Gym.
        """
        choice = await asyncio.to_thread(self.rollout_restorer.plan)
        restored = choice.restored
        if restored is None:
            return None
        self.install_restored(restored)
        await self.workers.refit(self._weights_for_refit(), self.trainer_version)
        self._restored_episodes = await self._environment_restore.enter_async_context(
            self.rollout_restorer.environment_restore_scope(restored)
        )
        return restored

    def install_restored(self, restored: RestoredRolloutState) -> None:
        """Install a checked restore and retrain its replay steps (before ``run``)."""
        if restored.trainer is not None:
            self.model.load_state_dict(restored.trainer.model_state)
            self.optimizer.load_state_dict(restored.trainer.optimizer_state)
            restore_rng(restored.trainer.rng_state)
        self.dataloader.load_state_dict(restored.dataloader_state)
        self.sampler.load_state_dict(restored.sampler_state)
        self.data_plane = restored.data_plane
        self.buffer = ReplayBuffer(self.cfg.rollout.replay_capacity)
        for group in restored.replay_groups:
            self.buffer.add(group)
        if restored.ledger is not None:
            self.ledger = restored.ledger
        self._rollout_runtime = restored.runtime_state
        self.trainer_version = restored.anchor_step
        for entry in restored.replay_steps:
            self._retrain(entry)
        if self.trainer_version != restored.train_step:
            raise ControllerError(
                f"replay reached step {self.trainer_version}, expected {restored.train_step}"
            )
        self.served_version = self.trainer_version
        self._durable_step = restored.anchor_step if restored.anchor_step > 0 else None
        self.resume = restored.source
        self._restored_from = restored
        self.rollout_snapshots = self._build_snapshotter()
        logger.info(
            "restored %s: anchor step %d, %d steps retrained, %d groups in replay",
            restored.source.path,
            restored.anchor_step,
            len(restored.replay_steps),
            len(restored.replay_groups),
        )

    async def _relaunch_restored(self) -> None:
        """Normalize a restored ledger and relaunch its unfinished groups before new prompts."""
        if self.resume.fresh:
            return
        if self.ledger is None:
            for _ in range(len(self.buffer)):
                await self.buffer.acquire_permit()
            self._trace_restore(0)
            return
        ledger = self.ledger
        runs: list[_GroupRun] = []
        async with self.barrier.checkpoint() as cut:
            async with self._environment_restore:  # kept; dropped if the ledger refuses it
                report = ledger.prepare_for_restart(cut, self._restored_episodes)
            for resumed in report.resumed:
                sibling_id, attempt_uuid = resumed.rollout_id.rsplit("_a", 1)
                group = ledger.group_of(sibling_id)
                self.trace.emit(
                    "attempt_restored",
                    group_id=group.group_id,
                    prompt_id=group.prompt.prompt_id,
                    generation_index=ledger.sibling(sibling_id).index,
                    attempt_uuid=attempt_uuid,
                    level="turn",
                )
            for episode in report.abandoned:
                sibling_id, attempt_uuid = episode.rollout_id.rsplit("_a", 1)
                group = ledger.group_of(sibling_id)
                self.trace.emit(
                    "attempt_abandoned",
                    group_id=group.group_id,
                    prompt_id=group.prompt.prompt_id,
                    generation_index=ledger.sibling(sibling_id).index,
                    attempt_uuid=attempt_uuid,
                    reason="restart",
                )
            self.data_plane.clear("staging", report.stale_row_keys)
            referenced = ledger.referenced_row_keys()
            self.data_plane.clear(
                "staging", [k for k in self.data_plane.list("staging") if k not in referenced]
            )
            for record in ledger.with_status(GroupStatus.GENERATING, GroupStatus.READY_TO_FINALIZE):
                target_step = record.target_step or self.trainer_version + 1
                place = self._rollout_runtime.place_of(
                    target_step, record.prompt.prompt_id, record.prompt.epoch
                )
                run = _GroupRun(
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
        for _ in range(len(runs) + len(self.buffer)):
            if self.buffer.permits.locked():
                raise ControllerError("restored work exceeds rollout.replayCapacity")
            await self.buffer.acquire_permit()
        for run in runs:
            self._launch(self._run_group(run), run.group_id)
        self._trace_restore(len(runs))
        logger.info(
            "resumed at step %d: %d groups relaunched, %d in replay, %d abandoned attempts",
            self.trainer_version,
            len(runs),
            len(self.buffer),
            len(report.abandoned),
        )

    def _trace_restore(self, redispatched: int) -> None:
        restored = self._restored_from
        self.trace.emit(
            "restore_completed",
            snapshot_id=restored.snapshot_id if restored else None,
            cut_time=restored.cut_time if restored else None,
            groups=len(self.buffer),
            redispatched=redispatched,
        )

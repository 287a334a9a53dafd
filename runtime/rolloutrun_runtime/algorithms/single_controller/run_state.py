"""The run state: one object that holds every live part of a run.

Why one object: the rollout pump, the train pump, the trainer checkpoints, the snapshotter
and the restore all work on the same parts (data plane, barrier, replay buffer, dataloader,
sampler, recovery ledger, rollout runtime state, policy and optimizer, the version
counters). Each part is built once here and handed to the others as this object, so a
restore fills it in place (``install``: the restored data plane, buffer, ledger and
runtime state go into the same ``parts`` the snapshotter reads, as torchtitan's
checkpointer loads a dict of stateful parts) and nothing is rebuilt after it.

How the parts talk through it: the pumps never call each other; they meet in these parts
and wake each other with ``signal``/``wait_for`` (one progress event). ``launch`` runs a
group's task and records the first failure, which ``wait_for`` re-raises in every waiter.
The locks stay with their owners: the barrier's cuts and mutations with the data plane,
the save lock (trainer checkpoints and snapshots) in ``parts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import RestoredRolloutState
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    ResumeSource,
    RolloutParts,
    RolloutRuntimeState,
    TrainingProgress,
)
from rolloutrun_runtime.algorithms.samplers import InOrderSampler, PromptDataloader
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.data_plane import DataPlane, DataPlaneBarrier
from rolloutrun_runtime.experience.rollout_recovery import RecoveryLedger
from rolloutrun_runtime.metrics import EnvironmentRestoreMetrics

logger = logging.getLogger(__name__)


class ControllerError(RuntimeError):
    """The controller cannot continue (a pump failed, a restore does not fit)."""


@dataclass
class StepCounters:
    """Per stamped step: why its groups were given up (for the error when none is left)."""

    given_up: list[str] = field(default_factory=list)


class TrainingHold:
    """A preemption notice holds the train pump before it computes another step.

    Why: the notice's forced snapshot cuts the run where it stands, and the run task is
    cancelled once it publishes. A step computed after that cut would be thrown away and
    trained again by the next incarnation (its metrics row written twice), while it takes
    the cores the snapshot needs within the grace period. The pump parks after its
    selection (a snapshot's cut keeps a step's claimed groups, as at any moment between a
    selection and its commit); a step already computing commits, and :meth:`idle` says
    when it has, so the controller can snapshot once more. A pump waiting for rollouts is
    idle: the notice never waits on generation.
    """

    def __init__(self) -> None:
        self._allowed = asyncio.Event()
        self._allowed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    def hold(self) -> None:
        self._allowed.clear()

    async def before_compute(self) -> None:
        """Return at once (the step is under way from here), or (held) park until cancelled."""
        if not self._allowed.is_set():
            await self._allowed.wait()
        self._idle.clear()

    def step_done(self) -> None:
        """The step computed since :meth:`before_compute` is committed and recorded; or the
        pump ended (``maxSteps``, an error)."""
        self._idle.set()

    async def idle(self, timeout_s: float) -> bool:
        """Whether no step is computing, waiting up to ``timeout_s`` for one to finish."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        return self._idle.is_set()


class RunState:
    """Every live part of a run, built once; restore fills it in place."""

    def __init__(
        self, cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        grpo = cfg.grpo
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        #: The parts both rollout-checkpointing halves read (the snapshotter holds this
        #: very object; ``install`` refills its slots).
        self.parts = RolloutParts(
            config=cfg,
            data_plane=DataPlane(),
            barrier=DataPlaneBarrier(),
            buffer=ReplayBuffer(cfg.rollout.replay_capacity),
            dataloader=PromptDataloader(cfg.task.dataset_size, cfg.seed),
            sampler=InOrderSampler(grpo.prompts_per_step, grpo.max_staleness, grpo.max_steps),
            ledger=RecoveryLedger() if cfg.uses_ledger else None,
            runtime_state=RolloutRuntimeState(),
            save_lock=asyncio.Lock(),
            read_progress=self.read_progress,
            log_metrics=lambda metrics: logger.debug("rollout metrics %s", dict(metrics)),
        )
        self.resume = ResumeSource()
        self.trainer_version = 0
        # The version the generation workers serve: admission and pinning must use it, not
        # the trainer's, or tokens generated between a commit and its refit look younger.
        self.served_version = 0
        self.optimizer_commit_in_progress = False
        self.durable_step: int | None = None
        self.step_counters: dict[int, StepCounters] = defaultdict(StepCounters)
        self.generated_tokens = 0
        self.groups_trained: list[str] = []
        self.trained_prompt_ids: list[int] = []
        self.history: list[dict[str, Any]] = []
        self.max_observed_age = 0
        #: What the environment refused of the restore (set by Resume; in every step record).
        self.environment_restore = EnvironmentRestoreMetrics()
        self._progress_changed = asyncio.Event()
        self.training = TrainingHold()
        self.tasks: set[asyncio.Task[None]] = set()
        self._fatal: BaseException | None = None

    # ================================================================== the parts
    @property
    def data_plane(self) -> DataPlane:
        return self.parts.data_plane

    @property
    def barrier(self) -> DataPlaneBarrier:
        return self.parts.barrier

    @property
    def buffer(self) -> ReplayBuffer:
        return self.parts.buffer

    @property
    def dataloader(self) -> PromptDataloader:
        return self.parts.dataloader

    @property
    def sampler(self) -> InOrderSampler:
        return self.parts.sampler

    @property
    def ledger(self) -> RecoveryLedger | None:
        return self.parts.ledger

    @property
    def runtime_state(self) -> RolloutRuntimeState:
        return self.parts.runtime_state

    @property
    def save_lock(self) -> asyncio.Lock:
        return self.parts.save_lock

    def read_progress(self) -> TrainingProgress:
        """The live training counters (the checkpoint halves' only view of the trainer)."""
        return TrainingProgress(
            trainer_version=self.trainer_version,
            optimizer_commit_in_progress=self.optimizer_commit_in_progress,
            durable_step=self.durable_step,
            max_steps=self.cfg.grpo.max_steps,
        )

    def install(self, restored: RestoredRolloutState) -> None:
        """Fill the parts in place from a checked restore (the retrain is the caller's)."""
        parts = self.parts
        parts.dataloader.load_state_dict(restored.dataloader_state)
        parts.sampler.load_state_dict(restored.sampler_state)
        parts.data_plane = restored.data_plane
        parts.buffer = ReplayBuffer(self.cfg.rollout.replay_capacity)
        for group in restored.replay_groups:
            parts.buffer.add(group)
        if restored.ledger is not None:
            parts.ledger = restored.ledger
        parts.runtime_state = restored.runtime_state
        self.trainer_version = restored.anchor_step

    # ================================================================== task coordination
    def launch(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self._fatal is None:
            logger.error("rollout task %s failed", task.get_name(), exc_info=error)
            self._fatal = error
            self._progress_changed.set()

    def signal(self) -> None:
        self._progress_changed.set()

    async def wait_for(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self._fatal is not None:
                raise ControllerError(f"a rollout task failed: {self._fatal}") from self._fatal
            self._progress_changed.clear()
            if ready():
                return
            await self._progress_changed.wait()

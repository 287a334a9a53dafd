"""The train pump: one GRPO optimizer step per admitted step, in order.

Why its own part: it runs concurrently with the rollout pump and meets it only through the
run state (see ``rollout_pump.py``). For each step it waits for the groups stamped with it
(or the step's shortfall), takes them out of the replay buffer under one
``group_removals`` mutation, computes group-normalized advantages and the PPO-clip loss in
one batched pass (in a thread, outside any cut), then applies the optimizer step and clears
the rows inside one ``sample_clears`` mutation: the optimizer-commit window, flagged by
``RunState.optimizer_commit_in_progress`` so a snapshot never publishes across it. After the
commit it refits the generation workers, reports the step (``hooks.on_step``), and asks the
trainer checkpoints (``checkpoints.py``) and the snapshotter whether this is their moment.

``retrain`` replays a journaled step from its kept rows; the restore uses it to bring the
weights from an older anchor up to a snapshot's step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rolloutrun_runtime.algorithms.grpo import accumulate_policy_gradients, batch_age
from rolloutrun_runtime.algorithms.gym_client import GymClient
from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    FinalizerResult,
    JournalGroup,
    TrainedStep,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.algorithms.single_controller.checkpoints import TrainerCheckpoints
from rolloutrun_runtime.algorithms.single_controller.hooks import RunHooks
from rolloutrun_runtime.algorithms.single_controller.rollout_pump import RolloutPump
from rolloutrun_runtime.algorithms.single_controller.run_state import ControllerError, RunState
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.experience.rollout_recovery import PromptRef
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.workers import PolicyWorkers

logger = logging.getLogger(__name__)

#: Rows per forward pass in a train step (larger steps are split, the loss normalized once).
MICRO_BATCH_ROWS = 512
#: Gradient-norm clip for the optimizer step.
MAX_GRAD_NORM = 1.0


@dataclass
class Selected:
    step: int
    groups: list[ReplayGroup]
    rows: list[dict[str, Any]]
    results: list[FinalizerResult] = field(default_factory=list)
    rollout_rewards: list[float] = field(default_factory=list)
    """Every rollout of the step's finalized or dropped groups (taken at the commit)."""


def weights_for_refit(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class TrainPump:
    """Trains the admitted steps in order, up to ``maxSteps``."""

    def __init__(
        self,
        state: RunState,
        *,
        rollouts: RolloutPump,
        checkpoints: TrainerCheckpoints,
        snapshots: RolloutSnapshotter,
        gym: GymClient,
        workers: PolicyWorkers,
        hooks: RunHooks,
        trace: TraceWriter,
        overhead: OverheadClock,
        pad_id: int,
    ) -> None:
        self.state = state
        self.cfg = state.cfg
        self.rollouts = rollouts
        self.checkpoints = checkpoints
        self.snapshots = snapshots
        self.gym = gym
        self.workers = workers
        self.hooks = hooks
        self.trace = trace
        self.overhead = overhead
        self.pad_id = pad_id

    async def run(self) -> None:
        try:
            await self._train_to_max_steps()
        finally:
            self.state.training.step_done()  # nothing computes any more

    async def _train_to_max_steps(self) -> None:
        state = self.state
        last = time.perf_counter()
        self.overhead.take()
        env_mark, tokens_mark = self.gym.env_seconds, state.generated_tokens
        while state.trainer_version < self.cfg.grpo.max_steps:
            step = state.trainer_version + 1
            selected = await self._select_groups(step)
            await state.training.before_compute()  # a preemption notice parks it here
            compute_started = time.perf_counter()
            stats = await asyncio.to_thread(self._compute_gradients, selected)
            loss_compute_s = time.perf_counter() - compute_started
            await self.commit_step(selected)
            refit_started = time.perf_counter()
            await self.workers.refit(weights_for_refit(state.model), state.trainer_version)
            state.served_version = state.trainer_version
            state.signal()
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
                tokens=state.generated_tokens - tokens_mark,
                env_s=self.gym.env_seconds - env_mark,
            )
            env_mark, tokens_mark = self.gym.env_seconds, state.generated_tokens
            state.history.append(record)
            self.trace.emit(
                "step_completed",
                step=record["step"],
                weight_version=state.trainer_version,
                groups=record["groups"],
                batch_age=record["batch_age"],
            )
            self.hooks.on_step(record)
            await self.checkpoints.finalize_deferred()
            if self.checkpoints.enabled and step % self.cfg.checkpointing.save_period == 0:
                await self.checkpoints.save()
            self.snapshots.train_step_completed(
                state.trainer_version, self.cfg.checkpointing.snapshot_every_steps
            )
            state.training.step_done()

    async def _select_groups(self, step: int) -> Selected:
        state = self.state
        prompts = self.cfg.grpo.prompts_per_step

        def ready() -> bool:
            have = len(state.buffer.ready_for(step))
            return have + state.runtime_state.shortfall(step) >= prompts

        await state.wait_for(ready)
        if not state.buffer.ready_for(step):
            # Never an optimizer step over nothing recorded as reward 0 / loss 0: every group
            # of the step failed as a sample (infrastructure never gives a group up).
            reasons = state.step_counters[step].given_up
            raise ControllerError(
                f"step {step} has no group to train: all {prompts} were given up"
                + (f" (last: {reasons[-1]})" if reasons else "")
            )
        async with state.barrier.mutation("group_removals") as cut:
            with self.overhead:
                stale = state.buffer.stale_before(step)
                if stale:
                    logger.warning("evicting %d stale groups before step %d", len(stale), step)
                    state.buffer.take([g.group_id for g in stale])
                    for group in stale:
                        state.runtime_state.pending_drops.append(self._prompt_of(group))
                        state.data_plane.clear("train", group.row_keys)
                        self.rollouts.discard_prompt_group(cut, group.group_id, "stale")
                    state.buffer.release_permit(len(stale))
                chosen = state.buffer.ready_for(step)
                if self.cfg.checkpointing.deterministic:
                    # Finalization order is timing; the trained order must not be.
                    chosen = sorted(chosen, key=self._deterministic_order)
                chosen = chosen[:prompts]
                ids = [g.group_id for g in chosen]
                state.buffer.take(ids)
                if state.ledger is not None:
                    state.ledger.claim(cut, ids, step)
                state.runtime_state.open_step_groups = list(chosen)
                rows = [
                    row for g in chosen for row in state.data_plane.get_many("train", g.row_keys)
                ]
        return Selected(step, chosen, rows)

    def _deterministic_order(self, group: ReplayGroup) -> tuple[int, int]:
        """A timing-free sort key: the group's prompt, ``(prompt_id, epoch)``.

        An epoch draws each prompt once and a step's groups are distinct drawn prompts (its
        slots' own or their reserve prompts), so no two groups of a step share a key: no tie
        is left for the random group ids to break.
        """
        prompt = self._prompt_of(group)
        return (prompt.prompt_id, prompt.epoch)

    def _compute_gradients(self, selected: Selected) -> dict[str, float]:
        """Forward, PPO-clip loss and backward over the step's rows (runs in a thread)."""
        model = self.state.model
        self.state.optimizer.zero_grad(set_to_none=True)
        if not selected.rows:
            return {"loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0}
        stats = accumulate_policy_gradients(
            model,
            selected.rows,
            [g.rewards for g in selected.groups],
            pad_id=self.pad_id,
            temperature=self.cfg.policy.temperature,
            clip_epsilon=self.cfg.grpo.clip_epsilon,
            micro_batch_rows=MICRO_BATCH_ROWS,
        )
        stats["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        )
        return stats

    async def commit_step(self, selected: Selected) -> None:
        """The optimizer-commit window: apply the step and clear its rows in one mutation."""
        state = self.state
        runtime = state.runtime_state
        step = selected.step
        ids = [g.group_id for g in selected.groups]
        state.optimizer_commit_in_progress = True
        try:
            async with state.barrier.mutation("sample_clears") as cut:
                crash_point("inside_optimizer_commit")
                if selected.groups:  # always, from the train pump (see ``_select_groups``)
                    state.optimizer.step()
                with self.overhead:
                    selected.rollout_rewards = runtime.step_rewards.pop(step, [])
                    self._journal_step(selected)
                    if not self.snapshots_keep_rows:
                        for group in selected.groups:
                            state.data_plane.clear("train", group.row_keys)
                    if state.ledger is not None:
                        state.ledger.remove_trained(cut, ids, step)
                    state.buffer.release_permit(len(ids))
                    runtime.open_step_groups = []
                    runtime.commit_reserve(step)
                    state.trainer_version = step
                    state.groups_trained.extend(ids)
                    for group in selected.groups:
                        result = runtime.finalizer_results.pop(group.group_id, None)
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
                    state.trained_prompt_ids.extend(g.prompt_id for g in selected.groups)
        finally:
            state.optimizer_commit_in_progress = False
        state.signal()

    @property
    def snapshots_keep_rows(self) -> bool:
        """With snapshots (a manifest store), trained rows stay until a save covers them."""
        return self.checkpoints.manifests is not None

    def _journal_step(self, selected: Selected) -> None:
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
        runtime = self.state.runtime_state
        keep = tuple(selected.groups) if self.snapshots_keep_rows else ()
        dropped, runtime.pending_drops = tuple(runtime.pending_drops), []
        runtime.journal.append(TrainedStep(selected.step, groups, keep, dropped))

    def _prompt_of(self, group: ReplayGroup) -> PromptRef:
        """A finalized group's prompt (its epoch is on its train rows)."""
        epoch = 0
        if group.row_keys:
            epoch = int(self.state.data_plane.get("train", group.row_keys[0]).get("epoch", 0))
        return PromptRef(group.prompt_id, epoch)

    def retrain(self, entry: TrainedStep) -> None:
        """Retrain a journaled step from its kept rows (resume from an older anchor)."""
        state = self.state
        groups = list(entry.row_groups)
        rows = [row for g in groups for row in state.data_plane.get_many("train", g.row_keys)]
        selected = Selected(entry.step, groups, rows)
        self._compute_gradients(selected)
        if groups:
            state.optimizer.step()
        state.trainer_version = entry.step

    def _step_record(
        self,
        selected: Selected,
        stats: Mapping[str, float],
        *,
        step_time: float,
        compute_s: float,
        refit_s: float,
        tokens: int,
        env_s: float,
    ) -> dict[str, Any]:
        step = selected.step
        state = self.state
        runtime = state.runtime_state
        versions: dict[int, int] = defaultdict(int)
        for result in selected.results:
            for version, count in result.tokens_by_version.items():
                versions[version] += count
        step_max_age = (step - 1) - min(versions) if versions else 0
        state.max_observed_age = max(state.max_observed_age, step_max_age)
        state.step_counters.pop(step, None)
        # Sorted: the mean must not depend on the order groups finished in.
        rewards = sorted(selected.rollout_rewards)
        trained_rewards = [r for g in selected.groups for r in g.rewards]
        overhead_s = self.overhead.take()
        record: dict[str, Any] = {
            "step": step,
            "weight_version": state.trainer_version,
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
            "shortfall": runtime.shortfall(step),
            "replacements": runtime.replacements.get(step, 0),
            "rollouts": len(rewards),
            "batch_age": batch_age(versions, step - 1),
            "max_token_age": step_max_age,
            "train_compute_s": compute_s,
            "refit_s": refit_s,
            "env_s": env_s,
            "controller_overhead_s": overhead_s,
            "controller_overhead_share": overhead_s / step_time if step_time > 0 else 0.0,
            "spare_prompts": len(runtime.spare_prompts),
            "reserved_prompts": len(runtime.reserved_prompts()),
            "replay_groups": len(state.buffer),
            **state.environment_restore.as_record(),
            "barrier_waits": {
                kind: round(stats_["total_s"], 6)
                for kind, stats_ in state.barrier.wait_telemetry().items()
            },
        }
        runtime.forget_step(step)
        return record

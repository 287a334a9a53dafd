"""The rollout pump: admit steps, reserve prompt groups, run their siblings, seal groups.

Why its own part: rollouts (multi-turn, through Gym servers) take very different times
from optimizer steps, so they run concurrently with the train pump and meet it only
through the run state: the replay buffer (sealed groups, one capacity permit each), the
sampler's target-step stamps (bounded staleness), the data plane (rows) and the recovery
ledger. The pumps never call each other.

The loop: wait until the sampler admits the next step and a permit per prompt is free; in
one ``prompt_reservations`` mutation advance the dataloader, stamp the target step and
reserve one ledger group per prompt; each group then dispatches its siblings to Gym
replicas (``rollout_dispatch``, ``rollout_failures`` mutations), stages every result in
the data plane (``rollout_seals``), and is finalized into ``train`` rows and the replay
buffer under one ``group_commits`` cut. A group with no learning signal (or one that ran
out of attempts) is replaced or counted as shortfall under ``group_discards``, as the drop
policy (``drop_policy.py``) decides.

Without a ledger (``checkpointing`` off) the dispatch mutations are not taken
(``_no_cut``); the seal, commit and discard mutations always are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutrun_runtime.algorithms.grpo import count_versions, zero_variance
from rolloutrun_runtime.algorithms.gym_client import (
    GymCallError,
    GymClient,
    GymOutageError,
    GymPolicyUnreachableError,
    GymReplica,
    GymResumeRefusedError,
    GymUnavailableError,
    carries_record,
    rollout_seed,
)
from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import FinalizerResult
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.algorithms.single_controller import drop_policy
from rolloutrun_runtime.algorithms.single_controller.drop_policy import DropAction
from rolloutrun_runtime.algorithms.single_controller.run_state import RunState
from rolloutrun_runtime.contract.run_config import TargetLevel
from rolloutrun_runtime.contract.wire import POLICY_UNREACHABLE
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.experience.rollout_recovery import (
    EnvironmentEpisode,
    Granularity,
    LiveCut,
    PromptRef,
    RestoreLevel,
    RolloutAttempt,
    new_attempt,
    new_uuid_hex,
    sibling_id_for,
)
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.workers import PolicyWorkers
from rolloutrun_runtime.workers.endpoints import PolicyEndpoints, PolicyOutageError

logger = logging.getLogger(__name__)


class _GroupGivenUp(Exception):
    """A sibling ran out of attempts; the whole group is given up."""


@dataclass
class GroupRun:
    """A group being generated (the in-memory side of a ledger group)."""

    group_id: str
    prompt: PromptRef
    target_step: int
    start_version: int
    staged: dict[int, str] = field(default_factory=dict)
    slot: int | None = None
    """Deterministic mode: the step slot the group fills (None: decided as asynchronous)."""
    resume: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    """Elastic members: by sibling, the episode record its next ``/run`` continues from."""


#: Elastic members: the episode record of (rollout id, environment attempt) in the newest
#: published snapshot, or None.
TurnRecords = Callable[[str, int], Mapping[str, Any] | None]


@contextlib.asynccontextmanager
async def _no_cut() -> AsyncIterator[None]:
    yield None


class RolloutPump:
    """Turns admitted steps into sealed groups in the replay buffer."""

    def __init__(
        self,
        state: RunState,
        *,
        gym: GymClient,
        workers: PolicyWorkers,
        trace: TraceWriter,
        overhead: OverheadClock,
        on_dispatched: Callable[[], None] | None = None,
        turn_records: TurnRecords | None = None,
    ) -> None:
        self.state = state
        #: Where a lost Gym's turn-level episodes find their last published records.
        self.turn_records = turn_records
        #: Told of each attempt dispatched under the ledger (the snapshot cadence by rollouts).
        self.on_dispatched = on_dispatched
        self.cfg = state.cfg
        self.gym = gym
        self.workers = workers
        #: The generation endpoints given to the Gyms (less those a Gym could not reach).
        self.policies = PolicyEndpoints(workers, self.cfg.rollout.gym_unreachable_seconds)
        self.trace = trace
        self.overhead = overhead
        self._in_flight = asyncio.Semaphore(self.cfg.rollout.max_in_flight_groups)
        level = self.cfg.checkpointing.target_level
        self._granularity = (
            Granularity.PROMPT_GROUP if level is TargetLevel.PROMPT_GROUP else Granularity.SIBLING
        )
        self._restore_level = {
            TargetLevel.TURN: RestoreLevel.TURN,
            TargetLevel.PROMPT_GROUP: RestoreLevel.PROMPT_GROUP,
        }.get(level, RestoreLevel.SIBLING)

    # ================================================================== the four dispatch methods
    def _dispatch_reservation(self, kind: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """A mutation slot counted as ``kind`` with ledger dispatch; nothing without it."""
        if self.state.ledger is not None:
            return self.state.barrier.mutation(kind)
        return _no_cut()

    def _reserve_prompt_group(
        self, cut: LiveCut | None, prompt: PromptRef, step: int, slot: int | None = None
    ) -> GroupRun:
        group_id = f"pg{new_uuid_hex()[:12]}"
        ledger = self.state.ledger
        served_version = self.state.served_version
        if ledger is not None:
            assert cut is not None
            ledger.reserve_group(
                cut,
                group_id=group_id,
                admission_id=f"step{step}",
                prompt=prompt,
                target_step=step,
                start_weight_version=served_version,
                group_size=self.cfg.grpo.group_size,
                granularity=self._granularity,
                restore_level=self._restore_level,
            )
            ledger.admit(cut, group_id)
            self.trace.emit(
                "group_reserved",
                group_id=group_id,
                prompt_id=prompt.prompt_id,
                epoch=prompt.epoch,
                target_step=step,
            )
        return GroupRun(group_id, prompt, step, served_version, slot=slot)

    def discard_prompt_group(self, cut: LiveCut | None, group_id: str, reason: str) -> None:
        if self.state.ledger is not None:
            assert cut is not None
            self.state.ledger.discard(cut, group_id, reason)

    def _admit_step(self, cut: LiveCut | None) -> int:
        """Stamp the next target step: inside the reservation cut with ledger dispatch."""
        if cut is not None:
            cut.require_live()
        return self.state.sampler.admit(self.state.served_version)

    # ================================================================== the pump
    async def run(self) -> None:
        state = self.state
        prompts = self.cfg.grpo.prompts_per_step
        while True:
            await state.wait_for(
                lambda: state.sampler.exhausted or state.sampler.admissible(state.served_version)
            )
            if state.sampler.exhausted:
                return
            for _ in range(prompts):
                await state.buffer.acquire_permit()
            async with self._dispatch_reservation("prompt_reservations") as cut:
                with self.overhead:
                    if self.cfg.checkpointing.deterministic:
                        refs = state.dataloader.next_prompts(prompts)
                        step = self._admit_step(cut)
                        drop_policy.reserve_spares(
                            self.cfg, state.runtime_state, state.dataloader, step, refs
                        )
                        crash_point("after_dataloader_advance")
                        slots: list[int | None] = list(range(prompts))
                    else:
                        drop_policy.refill_spare_pool(
                            self.cfg, state.runtime_state, state.dataloader
                        )
                        refs = state.dataloader.next_prompts(prompts)
                        crash_point("after_dataloader_advance")
                        step = self._admit_step(cut)
                        slots = [None] * prompts
                    runs = [
                        self._reserve_prompt_group(cut, ref, step, slot)
                        for ref, slot in zip(refs, slots, strict=True)
                    ]
            for run in runs:
                state.launch(self.run_group(run), run.group_id)

    async def run_group(self, run: GroupRun) -> None:
        reason: str | None = None
        try:
            async with self._in_flight:
                if self.cfg.checkpointing.deterministic:
                    await self.state.wait_for(
                        lambda: self.state.served_version >= run.target_step - 1
                    )
                async with asyncio.TaskGroup() as siblings:
                    for index in range(self.cfg.grpo.group_size):
                        if index not in run.staged:
                            siblings.create_task(self._run_sibling(run, index))
        except* _GroupGivenUp as given_up:
            reason = f"attempts exhausted: {given_up.exceptions[0]}"
        except* (GymOutageError, PolicyOutageError) as outage:
            raise outage.exceptions[0] from None  # the member loss, named, stops the trainer
        if reason is not None:
            await self._drop_group(run, reason, failed=True)
        else:
            await self._finalize_group(run)

    # ================================================================== one sibling
    async def _run_sibling(self, run: GroupRun, index: int) -> None:
        sibling_id = sibling_id_for(run.group_id, index)
        local_attempt = new_attempt(sibling_id) if self.state.ledger is None else None
        failures = 0
        unreachable_tries = 0
        lost_since: float | None = None  # of the generation endpoints it was given
        while True:
            async with self._dispatch_reservation("rollout_dispatch") as cut:
                ledger = self.state.ledger
                if ledger is not None:
                    attempt = ledger.sibling(sibling_id).current
                    owner = attempt.gym_instance_id if attempt.gym_attempt > 0 else None
                    replica = self.gym.pick(owner)
                    ledger.dispatch(cut, sibling_id, attempt.attempt_uuid, replica.instance_id)
                    self._trace_attempt(
                        "attempt_dispatched",
                        run,
                        index,
                        attempt.attempt_uuid,
                        gym_instance_id=replica.instance_id,
                        gym_attempt=attempt.gym_attempt,
                    )
                    if self.on_dispatched is not None:
                        self.on_dispatched()
                else:
                    assert local_attempt is not None
                    attempt = local_attempt
                    replica = self.gym.pick(None)
            try:
                row = await self._call_gym(replica, run, index, attempt.episode)
            except GymResumeRefusedError as error:  # a stale record (a side effect past it)
                logger.warning("rollout %s restarts from turn 0: %s", attempt.rollout_id, error)
                local_attempt = await self._redispatch(  # a new rollout id; no failed sample
                    run, index, attempt, error, "resume_refused", resume=False
                )
                continue
            except GymUnavailableError as error:
                unreachable_tries += 1
                local_attempt = await self._unreachable(
                    run, index, attempt, replica, error, unreachable_tries
                )
                continue
            except GymPolicyUnreachableError as error:  # a lost worker: as for a lost Gym
                unreachable_tries += 1
                lost_since = lost_since or time.monotonic()
                all_lost = self.policies.lost(error.policy_url, lost_since, f"{error}")
                local_attempt = await self._redispatch(
                    run, index, attempt, error, POLICY_UNREACHABLE
                )
                await asyncio.sleep(self.gym.backoff(unreachable_tries) if all_lost else 0.0)
                continue
            except GymCallError as error:
                failures += 1
                if self.state.ledger is not None:  # attempts failed before a restart count too
                    failures = self.state.ledger.sibling(sibling_id).failed_attempts + 1
                local_attempt = await self._attempt_failed(
                    run, index, attempt, error, failures, local_attempt
                )
                continue
            run.resume.pop(index, None)
            await self._seal(run, index, attempt, row)
            return

    async def _unreachable(
        self,
        run: GroupRun,
        index: int,
        attempt: RolloutAttempt,
        replica: GymReplica,
        error: GymUnavailableError,
        tries: int,
    ) -> RolloutAttempt | None:
        """Infrastructure, not a sample: no attempt of maxAttempts is spent; the sibling
        stays pending (GymOutageError past the budget). A turn-level episode with a record
        in the newest published snapshot goes on from it (same rollout id, ``gym_attempt +
        1``; the ``/run`` carries the record; :meth:`_member_resume`); any other gets a new
        attempt, because the lost replica may have started the old one (a new rollout id
        restarts from turn 0: its side effects are never replayed). Redispatched at once to
        a surviving replica, else after a backoff. Returns the next local attempt (without
        a ledger)."""
        spent = self.gym.outages.unreachable(replica.url, error)
        delay = self.gym.backoff(tries) if self.gym.all_down() else 0.0
        logger.log(
            logging.WARNING if tries == 1 else logging.DEBUG,
            "rollout %s: %s (unreachable for %.1fs); retrying in %.2fs",
            attempt.rollout_id,
            error,
            spent,
            delay,
        )
        local_attempt = await self._redispatch(run, index, attempt, error, "gym_unreachable")
        await asyncio.sleep(delay)
        return local_attempt

    async def _redispatch(
        self,
        run: GroupRun,
        index: int,
        attempt: RolloutAttempt,
        error: Exception,
        reason: str,
        resume: bool = True,
    ) -> RolloutAttempt | None:
        """Abandon ``attempt`` (infrastructure) and retry it, or resume it from its record."""
        sibling_id = sibling_id_for(run.group_id, index)
        async with self._dispatch_reservation("rollout_failures") as cut:
            ledger = self.state.ledger
            if ledger is None:
                return new_attempt(sibling_id)
            if not (resume and self._member_resume(cut, run, index, attempt)):
                run.resume.pop(index, None)
                ledger.abandon(cut, sibling_id, attempt.attempt_uuid, str(error))
                self._trace_attempt(
                    "attempt_abandoned", run, index, attempt.attempt_uuid, reason=reason
                )
                ledger.retry(cut, sibling_id)
        return None

    def _member_resume(
        self, cut: LiveCut, run: GroupRun, index: int, attempt: RolloutAttempt
    ) -> bool:
        """Under the cut: continue a lost replica's turn-level episode from its newest record
        (the newest published snapshot's copy of this attempt, else the record this attempt
        itself continued from). False where there is none: a restart from turn 0."""
        ledger = self.state.ledger
        assert ledger is not None
        lookup = self.turn_records if self.gym.resumes() else None
        record = lookup(attempt.rollout_id, attempt.gym_attempt) if lookup is not None else None
        record = record if record is not None else run.resume.get(index)
        if record is None or not carries_record(record, self.cfg.gym.request_max_bytes):
            return False  # none, or too big to ride in a /run under gym.requestMaxBytes
        sibling_id = sibling_id_for(run.group_id, index)
        if not ledger.resume_elsewhere(cut, sibling_id, attempt.attempt_uuid):
            return False
        run.resume[index] = record
        self._trace_attempt("attempt_restored", run, index, attempt.attempt_uuid, level="member")
        return True

    async def _attempt_failed(
        self,
        run: GroupRun,
        index: int,
        attempt: RolloutAttempt,
        error: GymCallError,
        failures: int,
        local_attempt: RolloutAttempt | None,
    ) -> RolloutAttempt | None:
        """A failed sample: retry under a new attempt, or give the group up once
        ``maxAttempts`` are spent. Returns the next local attempt (without a ledger)."""
        sibling_id = sibling_id_for(run.group_id, index)
        exhausted = failures >= self.cfg.rollout.max_attempts
        logger.warning(
            "rollout %s attempt failed (%d/%d): %s",
            attempt.rollout_id,
            failures,
            self.cfg.rollout.max_attempts,
            error,
        )
        async with self._dispatch_reservation("rollout_failures") as cut:
            ledger = self.state.ledger
            if ledger is not None:
                ledger.fail(cut, sibling_id, attempt.attempt_uuid, str(error))
                self._trace_attempt(
                    "attempt_failed", run, index, attempt.attempt_uuid, reason=str(error)
                )
                if not exhausted:
                    ledger.retry(cut, sibling_id)
            else:
                local_attempt = new_attempt(sibling_id)
        if exhausted:
            raise _GroupGivenUp(f"{sibling_id}: {error}") from error
        return local_attempt

    async def _seal(
        self, run: GroupRun, index: int, attempt: RolloutAttempt, row: dict[str, Any]
    ) -> None:
        """Stage a sibling's result and seal its attempt (one ``rollout_seals`` mutation)."""
        state = self.state
        key = attempt.episode.capture_key
        async with state.barrier.mutation("rollout_seals") as cut:
            with self.overhead:
                state.data_plane.put("staging", key, row)
                run.staged[index] = key
                if state.ledger is not None:
                    state.ledger.seal(
                        cut,
                        sibling_id_for(run.group_id, index),
                        attempt.attempt_uuid,
                        reward=row["reward"],
                        row_key=key,
                    )
                    self._trace_attempt("attempt_sealed", run, index, attempt.attempt_uuid)

    def _trace_attempt(
        self, event: str, run: GroupRun, index: int, attempt_uuid: str, **fields: Any
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
        self, replica: GymReplica, run: GroupRun, index: int, episode: EnvironmentEpisode
    ) -> dict[str, Any]:
        deterministic = self.cfg.checkpointing.deterministic
        sampling = {
            "temperature": self.cfg.policy.temperature,
            "max_new_tokens": self.cfg.task.max_new_tokens,
            "seed": rollout_seed(self.cfg.seed, run.prompt, index),
            "weight_version": run.target_step - 1 if deterministic else None,
        }
        row = await self.gym.run_episode(
            replica,
            episode,
            run.prompt.prompt_id,
            await self.policies.pick(),
            sampling,
            resume=run.resume.get(index),
        )
        self.state.generated_tokens += row["model_tokens"]
        return row

    # ================================================================== finalize or drop
    async def _finalize_group(self, run: GroupRun) -> None:
        state = self.state
        keys = [run.staged[i] for i in range(self.cfg.grpo.group_size)]
        rows = state.data_plane.get_many("staging", keys)
        rewards = [float(row["reward"]) for row in rows]
        if (
            self.cfg.grpo.drop_zero_variance_groups
            and zero_variance(rewards)
            and self._decide_drop(run, failed=False) is not DropAction.KEEP
        ):
            await self._drop_group(run, "zero reward variance", failed=False)
            return
        async with state.barrier.mutation("group_commits") as cut:
            with self.overhead:
                if state.ledger is not None:
                    state.ledger.begin_finalize(cut, run.group_id)
                crash_point("inside_finalize_commit")
                try:
                    row_keys, model_tokens, tokens_by_version = self._stage_train_rows(run, rows)
                    state.data_plane.clear("staging", keys)
                    if state.ledger is not None:
                        state.ledger.finish_finalize(cut, run.group_id)
                        self.trace.emit(
                            "group_sealed",
                            group_id=run.group_id,
                            prompt_id=run.prompt.prompt_id,
                            epoch=run.prompt.epoch,
                        )
                    state.buffer.add(
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
                    state.runtime_state.finalizer_results[run.group_id] = FinalizerResult(
                        group_id=run.group_id,
                        target_step=run.target_step,
                        rewards=rewards,
                        model_tokens=model_tokens,
                        tokens_by_version=dict(tokens_by_version),
                    )
                except Exception:
                    if state.ledger is not None:
                        state.ledger.finalization_unknown(cut, run.group_id)
                    raise
        state.signal()

    def _stage_train_rows(
        self, run: GroupRun, rows: list[dict[str, Any]]
    ) -> tuple[list[str], int, dict[int, int]]:
        """Put a finalizing group's rows into ``train`` (inside its ``group_commits`` cut);
        returns their keys, their model tokens and those tokens by weight version."""
        row_keys = []
        tokens_by_version: dict[int, int] = defaultdict(int)
        model_tokens = 0
        for index, row in enumerate(rows):
            row_key = sibling_id_for(run.group_id, index)
            train_row = dict(row)
            train_row["prompt_id"] = run.prompt.prompt_id
            train_row["target_step"] = run.target_step
            train_row["epoch"] = run.prompt.epoch
            self.state.data_plane.put("train", row_key, train_row)
            row_keys.append(row_key)
            model_tokens += int(row["model_tokens"])
            versions = count_versions(
                np.asarray(row["weight_versions"]), np.asarray(row["loss_mask"])
            )
            for version, count in versions.items():
                tokens_by_version[version] += count
        return row_keys, model_tokens, tokens_by_version

    def _record_rewards(self, step: int, rewards: list[float]) -> None:
        """Count a finalized or dropped group's rollouts toward its step's ``reward_mean``
        (call inside the mutation that finalizes or drops it: a cut saves them with it)."""
        if step > self.state.trainer_version:
            self.state.runtime_state.step_rewards.setdefault(step, []).extend(rewards)

    def _decide_drop(self, run: GroupRun, *, failed: bool) -> DropAction:
        return drop_policy.decide_group_drop(
            self.cfg, self.state.runtime_state, run.target_step, run.slot, failed=failed
        )

    async def _drop_group(self, run: GroupRun, reason: str, *, failed: bool) -> None:
        """Give a group up: replace it (keeping its permit) or count it as shortfall."""
        state = self.state
        runtime = state.runtime_state
        step = run.target_step
        action = self._decide_drop(run, failed=failed)
        if action is DropAction.KEEP:
            action = DropAction.SHORTFALL
        replacement: GroupRun | None = None
        async with state.barrier.mutation("group_discards") as cut:
            with self.overhead:
                staged = [k for k in run.staged.values() if state.data_plane.contains("staging", k)]
                rows = state.data_plane.get_many("staging", staged)
                self._record_rewards(step, [float(row["reward"]) for row in rows])
                state.data_plane.clear("staging", run.staged.values())
                self.discard_prompt_group(cut, run.group_id, reason)
                runtime.pending_drops.append(run.prompt)
                if state.ledger is not None:
                    self.trace.emit(
                        "group_dropped",
                        group_id=run.group_id,
                        prompt_id=run.prompt.prompt_id,
                        reason=reason,
                    )
                if action is DropAction.REPLACE:
                    runtime.replacements[step] = runtime.replacements.get(step, 0) + 1
                    prompt = drop_policy.replacement_prompt(
                        self.cfg, runtime, state.dataloader, step, run.slot
                    )
                    replacement = self._reserve_prompt_group(cut, prompt, step, run.slot)
                else:
                    runtime.batch_shortfall[step] = runtime.shortfall(step) + 1
                    state.buffer.release_permit()
                    if failed:
                        state.step_counters[step].given_up.append(f"{run.group_id}: {reason}")
        logger.debug("group %s for step %d dropped (%s): %s", run.group_id, step, reason, action)
        if replacement is not None:
            state.launch(self.run_group(replacement), replacement.group_id)
        state.signal()

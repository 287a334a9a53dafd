"""The drop and spare policy: what happens to a group with no learning signal.

Why one file: a dropped group is either replaced (from the spare pool, or in deterministic
mode from its own slot's reserve), given up as the step's shortfall, or kept with zero
advantage; the decision and the prompts it spends belong together, as JobSet keeps one file
per policy. The decisions (``decide_drop``, ``decide_slot_drop``) are pure functions of
counters; the pool functions read and change the rollout runtime state and draw from the
dataloader, and the rollout pump calls them inside the mutation that reserves or discards
the group (so a cut saves the pool with the ledger that refers to it).

With ``checkpointing.deterministic`` the decisions must not depend on finishing order: the
reservation cut also sets aside the step's spare reserve (one prompt per slot, slot ``i``
being the ``i``-th prompt of the reservation), and a dropped group is replaced by its own
slot's reserve prompt, or given up only when its slot is among the first
``int(P * (1 - minStepBatchFraction))`` (``decide_slot_drop``). Unused reserve prompts are
handed on to later steps once their step commits; the dataloader is drawn from nowhere else.
"""

from __future__ import annotations

import enum

from rolloutrun_runtime.algorithms.rollout_checkpointing.state import RolloutRuntimeState
from rolloutrun_runtime.algorithms.samplers import PromptDataloader, newest_trained_at_admission
from rolloutrun_runtime.algorithms.single_controller.run_state import ControllerError
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.experience.rollout_recovery import PromptRef

#: Most dropped groups of one step that are replaced from the spare pool, per prompt (in
#: deterministic mode: the reserve prompts each slot gets).
REPLACEMENTS_PER_PROMPT = 1


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


def decide_group_drop(
    cfg: RunConfig,
    state: RolloutRuntimeState,
    target_step: int,
    slot: int | None,
    *,
    failed: bool,
) -> DropAction:
    """The drop decision: slot-bound for a deterministic step with a reserve, else by
    the step's budgets (asynchronous mode, or a step admitted before a resume from a
    checkpoint that kept no reserves)."""
    grpo = cfg.grpo
    record = state.step_reserves.get(target_step)
    if slot is not None and record is not None:
        return decide_slot_drop(
            failed=failed,
            slot=slot,
            reserve_left=record.next_unused(slot) is not None,
            prompts_per_step=grpo.prompts_per_step,
            min_step_batch_fraction=grpo.min_step_batch_fraction,
        )
    return decide_drop(
        failed=failed,
        replacements=state.replacements.get(target_step, 0),
        shortfall=state.shortfall(target_step),
        prompts_per_step=grpo.prompts_per_step,
        min_step_batch_fraction=grpo.min_step_batch_fraction,
    )


# ====================================================================== the spare pool
def reserve_spares(
    cfg: RunConfig,
    state: RolloutRuntimeState,
    dataloader: PromptDataloader,
    step: int,
    refs: list[PromptRef],
) -> None:
    """Deterministic mode: record ``step``'s slots and set aside its reserve, one prompt
    per slot and replacement (none without zero-variance drops: a failed group is never
    replaced in deterministic mode, so the dataloader draws only the step's prompts)."""
    per_slot = REPLACEMENTS_PER_PROMPT if cfg.grpo.drop_zero_variance_groups else 0
    state.reserve_step(
        step,
        refs,
        per_slot * len(refs),
        newest_trained=newest_trained_at_admission(step, cfg.grpo.max_staleness),
        draw=dataloader.next_prompts,
    )


def refill_spare_pool(
    cfg: RunConfig, state: RolloutRuntimeState, dataloader: PromptDataloader
) -> None:
    pool = state.spare_prompts
    missing = cfg.rollout.spare_low_water - len(pool)
    if missing > 0:
        pool.extend(dataloader.next_prompts(missing))


def take_spare(
    cfg: RunConfig, state: RolloutRuntimeState, dataloader: PromptDataloader
) -> PromptRef:
    pool = state.spare_prompts
    if not pool:
        pool.extend(dataloader.next_prompts(max(1, cfg.rollout.spare_low_water)))
    return pool.pop(0)


def replacement_prompt(
    cfg: RunConfig,
    state: RolloutRuntimeState,
    dataloader: PromptDataloader,
    target_step: int,
    slot: int | None,
) -> PromptRef:
    """The prompt that replaces a dropped group: its slot's next reserve prompt (marked
    used), else the spare pool's next one (call under the discard mutation)."""
    record = state.step_reserves.get(target_step)
    if slot is not None and record is not None:
        position = record.next_unused(slot)
        if position is None:
            raise ControllerError(f"slot {slot} of step {target_step} has no reserve prompt left")
        record.used[position] = True
        return record.reserve[position]
    return take_spare(cfg, state, dataloader)

"""The prompt dataloader (dataset indices with a saveable cursor) and the in-order sampler.

Why indices: prompts are rebuilt from ``(task, seed, prompt_id)`` wherever they are needed,
so the dataloader only walks a per-epoch permutation of ``0..datasetSize-1`` and its whole
state is ``(epoch, position)``. A checkpoint that saves that cursor under the same cut as
the ledger and the spare pool can prove no drawn prompt was lost.

The in-order sampler stamps each admitted batch with the train step that will consume it
and refuses to run further ahead of the trainer than ``maxStaleness`` allows: a group
admitted for step ``s`` while the trainer holds version ``v`` is generated with weights
``>= v`` and trained by the step that starts from ``s - 1``, so its age is at most
``s - 1 - v <= maxStaleness``.

The same bound read the other way (:func:`newest_trained_at_admission`) says which steps are
certainly trained when step ``s`` is admitted, whatever the timing: deterministic mode hands
their unused spare reserves on to ``s`` (see ``RolloutRuntimeState.reserve_step``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutrun_runtime.experience.rollout_recovery import PromptRef


class SamplerError(RuntimeError):
    """A sampler or dataloader was asked for something it cannot do."""


class PromptDataloader:
    """Shuffled dataset indices, one permutation per epoch from the run seed."""

    def __init__(self, dataset_size: int, seed: int) -> None:
        if dataset_size < 1:
            raise SamplerError("dataset_size must be >= 1")
        self.dataset_size = dataset_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    @property
    def consumed(self) -> int:
        """Prompts drawn so far over all epochs."""
        return self.epoch * self.dataset_size + self.position

    def next_prompts(self, count: int) -> list[PromptRef]:
        """Draw ``count`` prompts, moving the cursor (and into the next epoch when needed)."""
        refs: list[PromptRef] = []
        for _ in range(count):
            if self.position >= self.dataset_size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            refs.append(PromptRef(int(self._order[self.position]), self.epoch, self.position))
            self.position += 1
        return refs

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dataset_size"]) != self.dataset_size:
            raise SamplerError(
                f"dataloader state is for a dataset of {state['dataset_size']} prompts, "
                f"this run has {self.dataset_size}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)


def staleness_allows(target_step: int, trainer_version: int, max_staleness: int) -> bool:
    """Whether a batch for ``target_step`` may start while the trainer holds ``trainer_version``."""
    return target_step - 1 - trainer_version <= max_staleness


def newest_trained_at_admission(target_step: int, max_staleness: int) -> int:
    """The newest step certainly trained when ``target_step`` is admitted (0: none).

    ``staleness_allows`` admits ``target_step`` only at a trainer version of at least
    ``target_step - 1 - max_staleness``; every step up to that version has committed. Steps
    after it may or may not have, depending on timing, so nothing deterministic may depend
    on them.
    """
    return max(0, target_step - 1 - max_staleness)


@dataclass
class InOrderSampler:
    """Stamps batches with consecutive target steps, bounded by staleness and ``max_steps``."""

    prompts_per_step: int
    max_staleness: int
    max_steps: int
    next_target_step: int = 1

    def admissible(self, trainer_version: int) -> bool:
        """Whether the next batch may be admitted now."""
        return self.next_target_step <= self.max_steps and staleness_allows(
            self.next_target_step, trainer_version, self.max_staleness
        )

    @property
    def exhausted(self) -> bool:
        """Every step up to ``max_steps`` has been admitted."""
        return self.next_target_step > self.max_steps

    def admit(self, trainer_version: int) -> int:
        """Commit the next batch's admission; returns its target step."""
        if not self.admissible(trainer_version):
            raise SamplerError(
                f"step {self.next_target_step} is not admissible at trainer version "
                f"{trainer_version} (max staleness {self.max_staleness}, "
                f"max steps {self.max_steps})"
            )
        step = self.next_target_step
        self.next_target_step += 1
        return step

    def state_dict(self) -> dict[str, int]:
        return {"next_target_step": self.next_target_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_target_step = int(state["next_target_step"])

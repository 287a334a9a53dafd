"""Task problems, rebuilt from ``(task config, run seed, prompt id)`` on every side.

Why rebuild instead of serialize: the trainer's dataloader yields dataset indices
(``prompt_id``), the recovery ledger and snapshots store only those indices, and the Gym
server rebuilds the same problem from the same triple. A snapshot therefore never carries
prompt text, and a resumed run cannot disagree with the original about what prompt ``17``
was. The verifier (``score``) lives with the Gym task (``environments.gym.tasks``), since
only the environment sees the final state.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from rolloutrun_runtime.contract.run_config import TaskConfig, TaskName


class TaskError(ValueError):
    """A problem cannot be built (bad prompt id, unknown task)."""


@dataclass(frozen=True)
class Problem:
    """One dataset entry: its index and the text the policy sees first."""

    prompt_id: int
    prompt_text: str


@dataclass(frozen=True)
class ArithmeticProblem(Problem):
    """``a+b=``; the answer is ``a + b``."""

    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b


@dataclass(frozen=True)
class ReachTargetProblem(Problem):
    """Move a counter from ``start`` to ``target`` with one tool call per turn."""

    target: int
    start: int = 0


def problem_rng(seed: int, task: TaskName, prompt_id: int) -> random.Random:
    """A generator that depends only on ``(seed, task, prompt_id)``, stable across Pythons."""
    digest = hashlib.sha256(f"{seed}:{task.value}:{prompt_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def reach_target_prompt(target: int, counter: int) -> str:
    """The opening text of a reach-target episode (goal, then the counter's state)."""
    return f"g{target} c{counter}>"


def make_problem(task: TaskConfig, seed: int, prompt_id: int) -> Problem:
    """The problem at dataset index ``prompt_id`` for ``task`` under the run ``seed``."""
    if not 0 <= prompt_id < task.dataset_size:
        raise TaskError(
            f"prompt_id {prompt_id} is outside the dataset (0..{task.dataset_size - 1})"
        )
    rng = problem_rng(seed, task.name, prompt_id)
    if task.name is TaskName.ARITHMETIC:
        a, b = rng.randint(0, task.max_operand), rng.randint(0, task.max_operand)
        return ArithmeticProblem(prompt_id=prompt_id, prompt_text=f"{a}+{b}=", a=a, b=b)
    if task.name is TaskName.REACH_TARGET:
        target = rng.randint(1, task.max_operand)
        return ReachTargetProblem(
            prompt_id=prompt_id, prompt_text=reach_target_prompt(target, 0), target=target
        )
    raise TaskError(f"unknown task {task.name!r}")

"""The Gym tasks: per-episode state, tool application, and the verifier (``score``).

Why a small ``TaskEnv`` contract: the agent loop is the same for every task (call the
model, apply its tool call, answer with an observation, repeat); a task only says how its
state starts, what a model turn does to it (the side effect, if any) and how the final
state scores. States are plain JSON mappings so an episode can be exported as a record and
installed elsewhere (turn-level recovery) without pickling.

Rewards are in [0, 1] and shaped so that GRPO sees reward variance from the first steps of
a freshly initialised policy: parsing is lenient (an answer or tool call is read from the
start of the model's text, trailing junk ignored), a clean one (nothing after it, then
``<eos>``) earns a little more, closeness to the goal earns more, the exact goal earns 1.
The policy first learns to start with a number, then to stop, then to be right.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from rolloutrun_runtime.contract.run_config import TaskConfig, TaskName
from rolloutrun_runtime.tasks import (
    ArithmeticProblem,
    Problem,
    ReachTargetProblem,
    TaskError,
    make_problem,
    reach_target_prompt,
)

_INTEGER = re.compile(r"-?\d{1,9}")
#: A move: ``+k``, ``-k``, a bare ``k`` (meaning ``+k``) or ``add(k)``.
_MOVE = re.compile(r"add\(([+-]?\d{1,9})\)|([+-]?\d{1,9})")

#: Arithmetic reward parts: a number read at the start, a clean answer, closeness, exact.
NUMBER_CREDIT, CLEAN_CREDIT, CLOSE_CREDIT, EXACT_CREDIT = 0.1, 0.1, 0.5, 0.3


@dataclass(frozen=True)
class TurnOutcome:
    """What one model turn did: its side effect (if any), the reply, and whether it ended."""

    effect: dict[str, Any] | None
    observation: str
    done: bool


class TaskEnv(Protocol):
    """One task's rules. ``state`` is a JSON mapping owned by the episode."""

    name: TaskName

    def start(self, problem: Problem) -> dict[str, Any]: ...

    def interpret(self, state: dict[str, Any], text: str, stopped: bool) -> dict[str, Any] | None:
        """The side effect the model's turn asks for (None: malformed, nothing to apply)."""
        ...

    def apply(self, state: dict[str, Any], effect: dict[str, Any] | None) -> TurnOutcome:
        """Apply ``effect`` to ``state`` in place and say what the model sees next."""
        ...

    def score(self, state: dict[str, Any]) -> float: ...


def closeness(value: int, goal: int, scale: int) -> float:
    """1 at the goal, falling linearly to 0 at ``scale`` away."""
    return max(0.0, 1.0 - abs(value - goal) / max(scale, 1))


class ArithmeticEnv:
    """Single turn: the model answers ``a+b=``; submitting the answer is the side effect."""

    name = TaskName.ARITHMETIC

    def __init__(self, task: TaskConfig) -> None:
        self.task = task

    def start(self, problem: Problem) -> dict[str, Any]:
        assert isinstance(problem, ArithmeticProblem)
        return {"a": problem.a, "b": problem.b, "submitted": None, "clean": False}

    def interpret(self, state: dict[str, Any], text: str, stopped: bool) -> dict[str, Any] | None:
        match = _INTEGER.match(text)
        value = int(match.group()) if match else None
        clean = match is not None and stopped and match.end() == len(text)
        return {"op": "submit", "value": value, "clean": clean, "text": text}

    def apply(self, state: dict[str, Any], effect: dict[str, Any] | None) -> TurnOutcome:
        assert effect is not None and effect["op"] == "submit"
        state["submitted"] = effect["value"]
        state["clean"] = effect["clean"]
        return TurnOutcome(effect=effect, observation="", done=True)

    def score(self, state: dict[str, Any]) -> float:
        value = state["submitted"]
        if value is None:
            return 0.0
        answer = state["a"] + state["b"]
        clean = bool(state.get("clean"))
        reward = NUMBER_CREDIT + CLOSE_CREDIT * closeness(value, answer, self.task.max_operand + 1)
        if clean:
            reward += CLEAN_CREDIT
            if value == answer:
                reward += EXACT_CREDIT
        return round(reward, 6)


class ReachTargetEnv:
    """Multi turn: ``+k``/``-k`` (or ``add(k)``) moves a counter; reach the target."""

    name = TaskName.REACH_TARGET

    def __init__(self, task: TaskConfig) -> None:
        self.task = task

    def start(self, problem: Problem) -> dict[str, Any]:
        assert isinstance(problem, ReachTargetProblem)
        return {
            "target": problem.target,
            "counter": problem.start,
            "moves": [],
            "malformed": 0,
            "clean": 0,
            "turns": 0,
        }

    def interpret(self, state: dict[str, Any], text: str, stopped: bool) -> dict[str, Any] | None:
        match = _MOVE.match(text)
        if match is None:
            return None
        step = int(match.group(1) or match.group(2))
        if abs(step) > self.task.max_operand:
            return None
        clean = stopped and match.end() == len(text)
        return {"op": "add", "k": step, "clean": clean}

    def apply(self, state: dict[str, Any], effect: dict[str, Any] | None) -> TurnOutcome:
        state["turns"] += 1
        if effect is None:
            state["malformed"] += 1
        else:
            state["counter"] += effect["k"]
            state["moves"].append(effect["k"])
            state["clean"] += int(effect["clean"])
        done = state["counter"] == state["target"] or state["turns"] >= self.task.max_turns
        mark = "" if effect is not None else "?"
        return TurnOutcome(effect=effect, observation=f" c{state['counter']}{mark}>", done=done)

    def score(self, state: dict[str, Any]) -> float:
        target, counter = state["target"], state["counter"]
        if counter == target:
            return 1.0
        turns = max(state["turns"], 1)
        valid = 1.0 - state["malformed"] / turns
        clean = state["clean"] / turns
        return round(0.1 * valid + 0.1 * clean + 0.6 * closeness(counter, target, target), 6)


def make_env(task: TaskConfig) -> ArithmeticEnv | ReachTargetEnv:
    """The environment rules for ``task.name``."""
    if task.name is TaskName.ARITHMETIC:
        return ArithmeticEnv(task)
    if task.name is TaskName.REACH_TARGET:
        return ReachTargetEnv(task)
    raise TaskError(f"unknown task {task.name!r}")


def score(task: TaskConfig, state: dict[str, Any]) -> float:
    """The verifier: the reward of an episode's final ``state`` under ``task``."""
    return make_env(task).score(state)


__all__ = [
    "ArithmeticEnv",
    "ReachTargetEnv",
    "TaskEnv",
    "TurnOutcome",
    "make_env",
    "make_problem",
    "reach_target_prompt",
    "score",
]

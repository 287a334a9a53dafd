"""A ``reach_target`` Gym agent loop driven in process by a scripted policy.

The policy is the real generation engine with scripted weights (each turn answers ``+1``), so
every turn applies one known side effect; the side-effect store tests of the Gym
(``test_effect_storage``, ``test_audit_file_store``) run their episodes through it.
"""

from __future__ import annotations

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.gym import (
    AgentLoop,
    Episode,
    EpisodeId,
    LocalPolicyClient,
    Phase,
    Sampling,
    SideEffectLog,
)
from rolloutrun_runtime.policy.generation import GenerationEngine
from rolloutrun_runtime.policy.scripted import PLUS_ONE_SCRIPT, scripted_state_dict
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.tasks import ReachTargetProblem, make_problem

CFG = RunConfig.model_validate(
    {
        "policy": {"device": "cpu"},
        "seed": 3,
        "task": {"name": "reach_target", "maxOperand": 3, "maxTurns": 4},
    }
)
NOWHERE = "http://127.0.0.1:9"  # the policy is called in process; /run still needs a URL


def target_of(prompt_id: int) -> int:
    problem = make_problem(CFG.task, CFG.seed, prompt_id)
    assert isinstance(problem, ReachTargetProblem)
    return problem.target - problem.start


#: A prompt whose episode takes three "+1" turns (three side effects).
THREE = next(p for p in range(CFG.task.dataset_size) if target_of(p) == 3)


def scripted_engine() -> GenerationEngine:
    """The generation engine whose every turn answers ``+1``."""
    state = scripted_state_dict(CFG.policy, PLUS_ONE_SCRIPT)
    return GenerationEngine(CFG.policy, TOKENIZER.vocab_size, TOKENIZER.eos_id, state, 0)


def agent(engine: GenerationEngine, effects: SideEffectLog) -> AgentLoop:
    return AgentLoop(
        CFG.task, CFG.seed, CFG.policy.max_seq_len, LocalPolicyClient(engine.generate), effects
    )


def fresh_episode(loop: AgentLoop, rollout_id: str, attempt: int = 0) -> Episode:
    sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=7)
    return loop.new_episode(EpisodeId(rollout_id, attempt), THREE, NOWHERE, sampling)


def bare_episode(name: str, phase: Phase) -> Episode:
    """An episode of no turns in ``phase``, for tests of what a replica keeps."""
    return Episode(
        episode_id=EpisodeId(name),
        prompt_id=0,
        policy_url="http://127.0.0.1:1",
        sampling=Sampling(temperature=1.0, max_new_tokens=4),
        state={},
        segments=[],
        phase=phase,
    )

"""The default run's task is learnable: a short GRPO loop lifts the reward on 2 CPU cores.

This is the hand-over check for the trainer: the real policy, generation engine (with a
refit after every step) and Gym agent loop and verifier, with a minimal GRPO step of the
test's own (group-normalised advantages, PPO-clip loss on the model tokens only).
"""

from __future__ import annotations

import asyncio
import random
import statistics

import torch

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.gym import (
    AgentLoop,
    Episode,
    EpisodeId,
    LocalPolicyClient,
    Sampling,
    SideEffectLog,
)
from rolloutrun_runtime.policy.generation import GenerationEngine
from rolloutrun_runtime.policy.model import build_model, token_logprobs
from rolloutrun_runtime.policy.tokenizer import TOKENIZER


def _batch(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B,T], a mask over predicted model tokens [B,T-1], behaviour logprobs."""
    sequences = [episode.token_ids() for episode in episodes]
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), TOKENIZER.pad_id)
    mask = torch.zeros((len(sequences), width - 1))
    behaviour = torch.zeros((len(sequences), width - 1))
    for row, episode in enumerate(episodes):
        ids[row, : len(sequences[row])] = torch.tensor(sequences[row])
        offset = 0
        for segment in episode.segments:
            count = len(segment.token_ids)
            if segment.kind == "model":
                mask[row, offset - 1 : offset - 1 + count] = 1.0
                behaviour[row, offset - 1 : offset - 1 + count] = torch.tensor(segment.logprobs)
            offset += count
    return ids, mask, behaviour


async def test_default_task_reward_rises_within_twenty_grpo_steps() -> None:
    cfg = RunConfig.model_validate({"policy": {"device": "cpu"}})
    grpo = cfg.grpo
    model = build_model(cfg.policy, TOKENIZER.vocab_size, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=grpo.learning_rate)
    engine = GenerationEngine(
        cfg.policy, TOKENIZER.vocab_size, TOKENIZER.eos_id, model.state_dict(), 0, seed=0
    )
    loop = AgentLoop(
        cfg.task,
        cfg.seed,
        cfg.policy.max_seq_len,
        LocalPolicyClient(engine.generate),
        SideEffectLog("learnability"),
    )
    sampling = Sampling(cfg.policy.temperature, cfg.task.max_new_tokens)
    order = random.Random(cfg.seed)
    curve = []
    try:
        for step in range(grpo.max_steps):
            prompts = order.sample(range(cfg.task.dataset_size), grpo.prompts_per_step)
            episodes = await asyncio.gather(
                *[
                    loop.run(loop.new_episode(EpisodeId(f"s{step}-p{p}-g{g}"), p, "", sampling))
                    for p in prompts
                    for g in range(grpo.group_size)
                ]
            )
            rewards = torch.tensor([e.reward for e in episodes]).view(-1, grpo.group_size)
            curve.append(rewards.mean().item())
            advantages = (rewards - rewards.mean(1, keepdim=True)) / (
                rewards.std(1, keepdim=True) + 1e-6
            )
            ids, mask, behaviour = _batch(episodes)
            ratio = torch.exp(token_logprobs(model, ids) - behaviour)
            adv = advantages.view(-1, 1)
            clipped = ratio.clamp(1 - grpo.clip_epsilon, 1 + grpo.clip_epsilon)
            objective = torch.minimum(ratio * adv, clipped * adv)
            loss = -(objective * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            await engine.refit(model.state_dict(), step + 1)
            # Every model token reports the version it was sampled under: the step's own.
            assert {v for e in episodes for s in e.segments for v in s.weight_versions or []} == {
                step
            }
    finally:
        await engine.stop()
    first, last = statistics.mean(curve[:5]), statistics.mean(curve[-5:])
    assert last > 2 * first and last - first > 0.07, curve

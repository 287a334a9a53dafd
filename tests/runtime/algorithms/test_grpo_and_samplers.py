"""GRPO math, batch age, the dataloader cursor, the in-order sampler's staleness bound and
the controller's small pure decisions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rolloutrun_runtime.algorithms.grpo import (
    batch_age,
    count_versions,
    group_advantages,
    pad_batch,
    ppo_clip_loss,
    zero_variance,
)
from rolloutrun_runtime.algorithms.gym_client import GymCallError, rollout_seed, segments_to_row
from rolloutrun_runtime.algorithms.samplers import InOrderSampler, PromptDataloader, SamplerError
from rolloutrun_runtime.algorithms.single_controller import DropAction, decide_drop
from rolloutrun_runtime.experience.rollout_recovery import PromptRef


def test_group_advantages_are_normalized() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.all(group_advantages(torch.tensor([0.5, 0.5])) == 0)
    assert zero_variance([1.0, 1.0]) and not zero_variance([1.0, 0.0])


def test_ppo_clip_loss_values_and_gradient_direction() -> None:
    behaviour = torch.log(torch.tensor([[0.5, 0.5]]))
    logits = torch.zeros(1, 2, requires_grad=True)
    logprobs = torch.log(torch.sigmoid(logits))  # 0.5 each: ratio 1
    mask = torch.tensor([[1.0, 0.0]])
    loss, stats = ppo_clip_loss(logprobs, behaviour, torch.tensor([2.0]), mask, 0.2)
    assert math.isclose(stats.loss, -2.0, rel_tol=1e-5)
    assert stats.tokens == 1 and stats.clip_fraction == 0.0
    loss.backward()
    assert logits.grad is not None
    assert logits.grad[0, 0] < 0  # descending raises the advantaged token's probability
    assert logits.grad[0, 1] == 0  # masked token gets no gradient


def test_ppo_clip_stops_gradient_outside_the_trust_region() -> None:
    behaviour = torch.log(torch.tensor([[0.1]]))
    logprob = torch.log(torch.tensor([[0.5]])).requires_grad_(True)  # ratio 5 > 1.2
    loss, stats = ppo_clip_loss(logprob, behaviour, torch.tensor([1.0]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert stats.clip_fraction == 1.0
    assert logprob.grad is not None and float(logprob.grad) == 0.0
    normalized, _ = ppo_clip_loss(
        logprob.detach(), behaviour, torch.tensor([1.0]), torch.ones(1, 1), 0.2, token_normalizer=4
    )
    assert math.isclose(float(normalized), float(loss.detach()) / 4, rel_tol=1e-6)


def test_batch_age_is_token_weighted() -> None:
    assert batch_age({3: 10}, 3) == 0.0
    assert batch_age({2: 30, 3: 10}, 3) == pytest.approx(0.75)
    assert batch_age({}, 5) == 0.0
    versions = np.array([-1, 2, 2, 3])
    assert count_versions(versions, np.array([0, 1, 1, 1])) == {2: 2, 3: 1}


def test_pad_batch() -> None:
    batch = pad_batch([np.array([1, 2, 3]), np.array([4])], 0, torch.long)
    assert batch.tolist() == [[1, 2, 3], [4, 0, 0]]


def test_dataloader_epochs_cursor_and_restore() -> None:
    loader = PromptDataloader(dataset_size=5, seed=3)
    first_epoch = loader.next_prompts(5)
    assert sorted(p.prompt_id for p in first_epoch) == [0, 1, 2, 3, 4]
    state = loader.state_dict()
    more = loader.next_prompts(7)
    assert [p.epoch for p in more] == [1] * 5 + [2] * 2
    again = PromptDataloader(dataset_size=5, seed=3)
    again.load_state_dict(state)
    assert again.next_prompts(7) == more
    assert loader.consumed == 12
    with pytest.raises(SamplerError, match="dataset of 5"):
        PromptDataloader(dataset_size=6, seed=3).load_state_dict(state)


def test_in_order_sampler_holds_the_staleness_bound() -> None:
    sampler = InOrderSampler(prompts_per_step=2, max_staleness=1, max_steps=4)
    assert sampler.admit(0) == 1
    assert sampler.admit(0) == 2  # step 2 from version 0: age <= 1
    assert not sampler.admissible(0)
    with pytest.raises(SamplerError, match="not admissible"):
        sampler.admit(0)
    assert sampler.admit(1) == 3
    assert sampler.admit(2) == 4
    assert sampler.exhausted and not sampler.admissible(10)
    synchronous = InOrderSampler(prompts_per_step=1, max_staleness=0, max_steps=3)
    assert synchronous.admit(0) == 1 and not synchronous.admissible(0)


def test_drop_decisions() -> None:
    common = {"prompts_per_step": 4, "min_step_batch_fraction": 0.5}
    assert decide_drop(failed=False, replacements=0, shortfall=0, **common) is DropAction.REPLACE
    assert decide_drop(failed=False, replacements=4, shortfall=1, **common) is DropAction.SHORTFALL
    assert decide_drop(failed=False, replacements=4, shortfall=2, **common) is DropAction.KEEP
    assert decide_drop(failed=True, replacements=4, shortfall=9, **common) is DropAction.SHORTFALL


def test_rollout_seed_is_stable_and_distinct() -> None:
    ref = PromptRef(7, 0, 1)
    assert rollout_seed(1, ref, 0) == rollout_seed(1, ref, 0)
    assert rollout_seed(1, ref, 0) != rollout_seed(1, ref, 1)
    assert 0 <= rollout_seed(1, ref, 3) < 2**31


def test_segments_to_row_masks_only_model_tokens() -> None:
    result = {
        "reward": 1.0,
        "instance_id": "gym-0",
        "segments": [
            {"kind": "prompt", "token_ids": [1, 5, 6]},
            {
                "kind": "model",
                "token_ids": [7, 2],
                "logprobs": [-0.1, -0.2],
                "weight_versions": [3, 4],
            },
            {"kind": "env", "token_ids": [9]},
        ],
    }
    row = segments_to_row(result, max_seq_len=16)
    assert row["input_ids"].tolist() == [1, 5, 6, 7, 2, 9]
    assert row["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0]
    assert row["weight_versions"].tolist() == [-1, -1, -1, 3, 4, -1]
    assert row["model_tokens"] == 2 and row["reward"] == 1.0
    with pytest.raises(GymCallError, match="over maxSeqLen"):
        segments_to_row(result, max_seq_len=4)
    broken = {"reward": 1.0, "segments": [{"kind": "model", "token_ids": [1, 2], "logprobs": []}]}
    with pytest.raises(GymCallError):
        segments_to_row(broken, max_seq_len=16)


def test_accumulate_policy_gradients_micro_batches_match_one_batch() -> None:
    from rolloutrun_runtime.algorithms.grpo import accumulate_policy_gradients
    from rolloutrun_runtime.contract.run_config import PolicyConfig
    from rolloutrun_runtime.policy.model import build_model

    cfg = PolicyConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    rng = np.random.default_rng(0)
    rows = []
    for length in (5, 7, 6, 4):
        mask = np.zeros(length, dtype=np.int8)
        mask[2:] = 1
        rows.append(
            {
                "input_ids": rng.integers(3, 20, size=length),
                "behaviour_logprobs": np.full(length, -3.0, dtype=np.float32),
                "loss_mask": mask,
            }
        )
    rewards = [[1.0, 0.0], [0.2, 0.8]]
    grads = []
    for micro in (4, 1):
        model = build_model(cfg, 24, seed=1)
        stats = accumulate_policy_gradients(
            model,
            rows,
            rewards,
            pad_id=0,
            temperature=1.0,
            clip_epsilon=0.2,
            micro_batch_rows=micro,
        )
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
        assert math.isfinite(stats["loss"])
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert grads[0].abs().sum() > 0
    with pytest.raises(ValueError, match="rewards"):
        accumulate_policy_gradients(
            model, rows, [[1.0]], pad_id=0, temperature=1.0, clip_epsilon=0.2, micro_batch_rows=4
        )


async def test_replay_buffer_groups_and_permits() -> None:
    from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer, ReplayError, ReplayGroup

    def group(gid: str, step: int) -> ReplayGroup:
        return ReplayGroup(gid, 1, step, (f"{gid}_g0",), (1.0,), 3)

    buffer = ReplayBuffer(capacity=2)
    await buffer.acquire_permit()
    await buffer.acquire_permit()
    assert buffer.permits.locked()
    buffer.add(group("a", 1))
    buffer.add(group("b", 2))
    with pytest.raises(ReplayError, match="already"):
        buffer.add(group("a", 1))
    assert [g.group_id for g in buffer.ready_for(2)] == ["b"]
    assert [g.group_id for g in buffer.stale_before(2)] == ["a"]
    assert ReplayGroup.from_json(buffer.metadata()[0]) == group("a", 1)
    taken = buffer.take(["a"])
    with pytest.raises(ReplayError, match="not in the replay buffer"):
        buffer.take(["a"])
    buffer.put_back(taken)
    buffer.release_permit(2)
    assert not buffer.permits.locked() and len(buffer) == 2


async def test_gym_client_placement_and_unhealthy_replicas() -> None:
    import socket

    from rolloutrun_runtime.algorithms.gym_client import GymClient, GymUnavailableError
    from rolloutrun_runtime.metrics import OverheadClock

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    client = GymClient(
        [dead, dead + "/"],
        timeout_s=5,
        max_seq_len=16,
        overhead=OverheadClock(),
        unreachable_budget_s=0.2,
    )
    assert [client.pick(None).instance_id for _ in range(3)] == ["gym-0", "gym-1", "gym-0"]
    for replica in client.replicas:  # as if each had answered /healthz under its own id
        replica.identified = True
    assert client.pick("gym-1").url == dead
    with pytest.raises(GymUnavailableError, match="owns a resumed episode"):
        client.pick("gym-9")
    with pytest.raises(GymUnavailableError, match="no Gym replica answered"):
        await client.open()
    with pytest.raises(GymUnavailableError, match="not open"):
        await client.run_episode(client.replicas[0], None, 0, "http://x", {})  # type: ignore[arg-type]

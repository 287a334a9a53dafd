"""GRPO math: group-normalized advantages, the PPO-clip loss and batch age.

Kept as pure functions over tensors so they are tested alone and the controller's train
step is a few batched calls: one padded batch, one forward pass, one loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within one group (population std)."""
    rewards = rewards.float()
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


def zero_variance(rewards: Sequence[float]) -> bool:
    """Whether every reward in the group is the same (no learning signal)."""
    return len(rewards) > 0 and max(rewards) == min(rewards)


@dataclass(frozen=True)
class LossStats:
    loss: float
    clip_fraction: float
    ratio_mean: float
    approx_kl: float
    tokens: int


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
    token_normalizer: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Token-mean PPO-clip surrogate over ``mask``ed tokens.

    Shapes: ``logprobs``, ``behaviour_logprobs`` and ``mask`` are [B, T]; ``advantages`` is
    [B] (one per sequence, broadcast over its tokens). ``token_normalizer`` replaces this
    batch's token count when a step is split into micro-batches (pass the step's total).
    """
    mask = mask.float()
    tokens = mask.sum().clamp(min=1.0)
    normalizer = tokens if token_normalizer is None else max(token_normalizer, 1.0)
    log_ratio = (logprobs - behaviour_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.float()[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * adv
    loss = -(torch.minimum(unclipped, clipped) * mask).sum() / normalizer
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_epsilon).float() * mask
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(was_clipped.sum() / tokens),
            ratio_mean=float((ratio * mask).sum() / tokens),
            approx_kl=float(((ratio - 1.0 - log_ratio) * mask).sum() / tokens),
            tokens=int(mask.sum()),
        )
    return loss, stats


def batch_age(tokens_by_version: Mapping[int, int], trained_from_version: int) -> float:
    """Token-weighted policy updates between generating each token and training on it.

    A token generated with weights ``w`` and trained by the step that starts from version
    ``trained_from_version`` waited ``trained_from_version - w`` updates.
    """
    total = sum(tokens_by_version.values())
    if total == 0:
        return 0.0
    weighted = sum((trained_from_version - v) * n for v, n in tokens_by_version.items())
    return weighted / total


def count_versions(weight_versions: np.ndarray, mask: np.ndarray) -> dict[int, int]:
    """Per weight version, how many masked (model) tokens carry it."""
    versions, counts = np.unique(weight_versions[mask.astype(bool)], return_counts=True)
    return {int(v): int(c) for v, c in zip(versions, counts, strict=True)}


def pad_batch(
    sequences: Sequence[np.ndarray], pad_value: float | int, dtype: torch.dtype
) -> torch.Tensor:
    """Right-pad 1-D arrays into one [B, T] tensor."""
    length = max(len(s) for s in sequences)
    out = np.full((len(sequences), length), pad_value, dtype=np.asarray(sequences[0]).dtype)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = seq
    return torch.as_tensor(out, dtype=dtype)


def accumulate_policy_gradients(
    model: torch.nn.Module,
    rows: Sequence[Mapping[str, Any]],
    group_rewards: Sequence[Sequence[float]],
    *,
    pad_id: int,
    temperature: float,
    clip_epsilon: float,
    micro_batch_rows: int,
) -> dict[str, float]:
    """Backward the step's PPO-clip loss into ``model``'s gradients; returns loss stats.

    ``rows`` are the groups' training rows in group order (``input_ids``,
    ``behaviour_logprobs``, ``loss_mask``), ``group_rewards`` their rewards. The loss is the
    token mean over the whole step, however the rows are split into micro-batches.
    """
    from rolloutrun_runtime.policy.model import token_logprobs

    advantages: list[float] = []
    for rewards in group_rewards:
        advantages.extend(group_advantages(torch.tensor(list(rewards))).tolist())
    if len(advantages) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(advantages)} rewards")
    device = next(model.parameters()).device
    total_tokens = float(sum(int(np.asarray(row["loss_mask"])[1:].sum()) for row in rows))
    totals = {"loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
    model.train()
    for start in range(0, len(rows), micro_batch_rows):
        chunk = rows[start : start + micro_batch_rows]
        input_ids = pad_batch([r["input_ids"] for r in chunk], pad_id, torch.long).to(device)
        behaviour = pad_batch([r["behaviour_logprobs"] for r in chunk], 0.0, torch.float32)
        mask = pad_batch([r["loss_mask"] for r in chunk], 0, torch.float32)
        adv = torch.tensor(advantages[start : start + len(chunk)])
        loss, stats = ppo_clip_loss(
            token_logprobs(model, input_ids, temperature),
            behaviour[:, 1:].to(device),
            adv.to(device),
            mask[:, 1:].to(device),
            clip_epsilon,
            token_normalizer=total_tokens,
        )
        loss.backward()
        share = stats.tokens / max(total_tokens, 1.0)
        totals["loss"] += stats.loss
        totals["clip_fraction"] += stats.clip_fraction * share
        totals["approx_kl"] += stats.approx_kl * share
        totals["ratio_mean"] += stats.ratio_mean * share
    return totals

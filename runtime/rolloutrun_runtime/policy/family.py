"""The one seam between the runtime and the policy's model family.

Why one seam: the trainer, the GRPO loss, refits, checkpoints, the generation engine and
the Gym's agent must not care whether the policy is the built-in ``TinyCausalLM`` over the
character tokenizer or a Hugging Face causal LM (``policy.model``). They ask this module
for a tokenizer (``policy_tokenizer``, defined beside the built-in tokenizer so the Gym
imports no torch) and a freshly built model (``build_policy_model``)
and use only the surface both families share: ``PolicyTokenizer`` and ``PolicyModel``.
The Hugging Face family is imported only when ``policy.model`` is set, so the built-in path
never pays for ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from rolloutrun_runtime.contract.run_config import PolicyConfig, PolicyDtype
from rolloutrun_runtime.policy.model import build_model, resolve_device
from rolloutrun_runtime.policy.tokenizer import TOKENIZER, PolicyTokenizer, policy_tokenizer

__all__ = [
    "PolicyModel",
    "PolicyTokenizer",
    "build_policy_model",
    "is_hf",
    "policy_tokenizer",
    "resolve_dtype",
]


class PolicyModel(Protocol):
    """What the runtime asks of a model (besides ``nn.Module``'s state dict/parameters):
    ``forward(input_ids)`` -> logits, and the engine's KV-cached path."""

    vocab_size: int
    max_seq_len: int

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def new_cache(
        self, rows: int, device: torch.device, dtype: torch.dtype | None = None
    ) -> torch.Tensor: ...

    def forward_cached(
        self, input_ids: torch.Tensor, start: torch.Tensor, cache: torch.Tensor
    ) -> torch.Tensor: ...


_DTYPES = {
    PolicyDtype.FLOAT32: torch.float32,
    PolicyDtype.BFLOAT16: torch.bfloat16,
    PolicyDtype.FLOAT16: torch.float16,
}


def resolve_dtype(cfg: PolicyConfig, device: torch.device) -> torch.dtype:
    """``policy.dtype``; ``auto`` is bfloat16 for a Hugging Face model on CUDA, else float32."""
    if cfg.dtype is not PolicyDtype.AUTO:
        return _DTYPES[cfg.dtype]
    if cfg.model is not None and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def build_policy_model(
    cfg: PolicyConfig,
    seed: int,
    vocab_size: int | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """A fresh policy on its device and dtype. The built-in model is initialised from
    ``seed`` (over ``vocab_size``, the built-in tokenizer's by default); a Hugging Face model
    loads its weights from ``policy.model``. Either way the same config gives the same
    weights, and torch's global RNG is left as it was. With ``weights`` (a state dict of
    this policy) the model holds copies of them instead, and a Hugging Face model reads
    none of its own."""
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if cfg.model is None:
        model = build_model(cfg, vocab_size or TOKENIZER.vocab_size, seed)
        if weights is not None:
            model.load_state_dict(dict(weights))
        return model if dtype == torch.float32 else model.to(dtype=dtype)
    from rolloutrun_runtime.policy.hf import build_hf_model

    return build_hf_model(cfg.model, cfg.max_seq_len, device, dtype, weights)


def is_hf(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face policy (without importing that family)."""
    return hasattr(model, "hf_state_dict")

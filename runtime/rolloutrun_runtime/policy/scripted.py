"""Hand-set TinyCausalLM weights that follow a bigram script.

Why: tests and crash campaigns need multi-turn episodes whose tool calls are known in
advance (a fresh policy almost never emits a valid ``+k``), yet they should exercise the
real model, engine and refit path rather than a stand-in. These weights turn the
transformer into a bigram model: every block adds nothing to the residual stream, the
position embeddings are zero, each token embeds as a one-hot vector, and the head maps the
final norm's output to a chosen row of logits. The next-token distribution then depends on
the current token only: ``>`` → ``+`` → ``1`` → ``<eos>`` makes ``+1`` every turn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rolloutrun_runtime.contract.run_config import PolicyConfig
from rolloutrun_runtime.policy.model import build_model
from rolloutrun_runtime.policy.tokenizer import TOKENIZER


class ScriptError(ValueError):
    """A script the model cannot express (vocabulary wider than the model)."""


def bigram_state_dict(
    cfg: PolicyConfig, vocab_size: int, logits: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Weights whose next-token logits after token ``x`` are ``logits[x]`` (shape [V, V])."""
    width = cfg.d_model
    if width < vocab_size + 1:
        raise ScriptError(
            f"a bigram script needs policy.dModel > vocabulary size ({vocab_size}), got {width}"
        )
    if tuple(logits.shape) != (vocab_size, vocab_size):
        raise ScriptError(f"logits must be [{vocab_size}, {vocab_size}], got {tuple(logits.shape)}")
    state = {
        k: torch.zeros_like(v) for k, v in build_model(cfg, vocab_size, 0).state_dict().items()
    }
    for key in state:
        if key.endswith(("ln1.weight", "ln2.weight")):
            state[key].fill_(1.0)
    state["tok_emb.weight"][:, :vocab_size] = torch.eye(vocab_size)
    state["ln_f.weight"].fill_(1.0)
    # LayerNorm maps the one-hot e_x to (e_x - 1/d) / sigma; a head whose columns sum to
    # zero turns that into column x / sigma, so column x = sigma * logits[x].
    sigma = math.sqrt(1.0 / width - 1.0 / width**2 + 1e-5)
    head = torch.zeros((vocab_size, width))
    head[:, :vocab_size] = sigma * logits.T
    head[:, vocab_size] = -head[:, :vocab_size].sum(dim=1)
    state["head.weight"] = head
    return state


def script_logits(
    vocab_size: int, transitions: Mapping[int, int], confidence: float = 30.0
) -> torch.Tensor:
    """Bigram logits: after ``x`` emit ``transitions[x]`` (others stay uniform)."""
    logits = torch.zeros((vocab_size, vocab_size))
    for current, following in transitions.items():
        logits[current, following] = confidence
    return logits


def scripted_state_dict(
    cfg: PolicyConfig, script: Mapping[str, str], confidence: float = 30.0
) -> dict[str, torch.Tensor]:
    """Weights following a character script, e.g. ``{">": "+", "+": "1", "1": "<eos>"}``."""

    def token(name: str) -> int:
        return TOKENIZER.eos_id if name == "<eos>" else TOKENIZER.encode(name)[0]

    transitions = {token(a): token(b) for a, b in script.items()}
    logits = script_logits(TOKENIZER.vocab_size, transitions, confidence)
    return bigram_state_dict(cfg, TOKENIZER.vocab_size, logits)


#: A reach-target player that moves ``+1`` every turn.
PLUS_ONE_SCRIPT = {">": "+", "+": "1", "1": "<eos>"}

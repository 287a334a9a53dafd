"""TinyCausalLM: a small pre-norm causal transformer, with a KV-cached path for generation.

Why this shape: the runtime's job is to make RL runs survive preemption, not to train a
good model, but recovery must be exercised by a policy that really learns (rewards rise,
weights change every step, refits matter). A 2-layer, 64-wide transformer over a character
vocabulary learns the example tasks within minutes on 2 CPU cores.

Two entry points share the weights:

- ``forward(input_ids)`` scores whole sequences (training, ``token_logprobs``);
- ``forward_cached(...)`` appends new tokens to per-row key/value buffers, so the
  generation engine's decode step costs one token per running call instead of the whole
  prefix (rows may sit at different positions: continuous batching).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from rolloutrun_runtime.contract.run_config import Device, PolicyConfig


class ModelError(ValueError):
    """Inputs that the model cannot take (too long, wrong shape)."""


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.n_heads * self.head_dim, dim=-1)
        shape = (batch, length, self.n_heads, self.head_dim)
        return q.view(shape), k.view(shape), v.view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self._split(x)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))

    def forward_cached(
        self,
        x: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``x`` [n,S,D] at ``positions`` [n,S]; caches [n,H,T,Dh] are updated in place."""
        batch, length, width = x.shape
        q, k, v = self._split(x)
        # cache[rows, :, positions] has shape [n, S, H, Dh] (advanced indices go first).
        cache_k[rows, :, positions] = k
        cache_v[rows, :, positions] = v
        span = mask.shape[-1]
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), cache_k[:, :, :span], cache_v[:, :, :span], attn_mask=mask
        )
        x = x + self.proj(att.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """Token and learned position embeddings, pre-norm blocks, a final norm and a head."""

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_seq_len: int
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ModelError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B,T,V] for ``input_ids`` [B,T]; position t sees tokens 0..t."""
        if input_ids.dim() != 2:
            raise ModelError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        length = input_ids.shape[1]
        if length > self.max_seq_len:
            raise ModelError(f"sequence of {length} tokens exceeds max_seq_len {self.max_seq_len}")
        positions = torch.arange(length, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def new_cache(
        self, rows: int, device: torch.device, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """An empty KV buffer [layers, 2, rows, heads, max_seq_len, head_dim] (in the
        weights' dtype unless ``dtype`` says otherwise)."""
        head_dim = self.d_model // self.n_heads
        dtype = dtype or self.head.weight.dtype
        return torch.zeros(
            (self.n_layers, 2, rows, self.n_heads, self.max_seq_len, head_dim),
            device=device,
            dtype=dtype,
        )

    def forward_cached(
        self, input_ids: torch.Tensor, start: torch.Tensor, cache: torch.Tensor
    ) -> torch.Tensor:
        """Append ``input_ids`` [n,S] at per-row offsets ``start`` [n] to ``cache``.

        ``cache`` is a view [layers, 2, n, heads, max_seq_len, head_dim] whose row i holds
        the keys and values of row i's first ``start[i]`` tokens. Rows may be right-padded:
        a padded position writes keys that later tokens overwrite before anyone attends to
        them. Returns logits [n,S,V].
        """
        positions, _span, rows, mask = cache_geometry(input_ids, start, self.max_seq_len)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for layer, block in enumerate(self.blocks):
            assert isinstance(block, _Block)
            x = block.forward_cached(x, cache[layer, 0], cache[layer, 1], rows, positions, mask)
        return self.head(self.ln_f(x))


def resolve_device(cfg: PolicyConfig) -> torch.device:
    """CUDA when the config asks for it (or ``auto`` finds it), else CPU."""
    if cfg.device is Device.CUDA:
        if not torch.cuda.is_available():
            raise ModelError("policy.device is 'cuda' but no CUDA device is available")
        return torch.device("cuda")
    if cfg.device is Device.AUTO and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def build_model(cfg: PolicyConfig, vocab_size: int, seed: int) -> TinyCausalLM:
    """A freshly initialised model; the same ``(cfg, vocab_size, seed)`` gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyCausalLM(
            vocab_size=vocab_size,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            max_seq_len=cfg.max_seq_len,
        )
    return model.to(resolve_device(cfg))


def token_logprobs(
    model: nn.Module, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for every t: shape [B, T-1].

    ``temperature`` scales the logits as the generation service does when sampling, so
    the result matches the behaviour logprobs it reports.
    """
    logits = model(input_ids)[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def state_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over each entry's key, dtype, shape and bytes, in the mapping's key order."""
    digest = hashlib.sha256()
    for key, tensor in state_dict.items():
        data = tensor.detach().to("cpu").contiguous()
        digest.update(key.encode())
        digest.update(str(data.dtype).encode())
        digest.update(repr(tuple(data.shape)).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def cache_geometry(
    input_ids: torch.Tensor, start: torch.Tensor, max_seq_len: int
) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """Where a cached forward's tokens land, for every model family: each row's positions
    [n,S] from its own ``start``, the cache span they reach (refused past ``max_seq_len``),
    the row index [n,1] and the causal mask over the span [n,1,S,span]."""
    batch, length = input_ids.shape
    offsets = torch.arange(length, device=input_ids.device)
    positions = start[:, None] + offsets[None, :]
    span = int(positions.max()) + 1
    if span > max_seq_len:
        raise ModelError(f"sequence reaches {span} tokens, over max_seq_len {max_seq_len}")
    rows = torch.arange(batch, device=input_ids.device)[:, None]
    keys = torch.arange(span, device=input_ids.device)
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]
    return positions, span, rows, mask

"""Hugging Face causal LMs as the policy: the model and its KV cache (the directory and the
tokenizer are ``hf_files.py``).

Why a wrapper: the trainer, the GRPO loss, refits and checkpoints only need a module whose
``forward(input_ids)`` gives logits and whose ``state_dict`` round-trips; the generation
engine also needs ``new_cache``/``forward_cached`` over a KV buffer in which every row sits
at its own position (continuous batching). ``HFCausalLM`` gives an
``AutoModelForCausalLM`` exactly the built-in model's surface: its cache is one tensor
``[layers, 2, rows, kv_heads, max_seq_len, head_dim]`` that ``_RowCache`` hands to the
model's attention layers through the ``Cache.update`` hook, with a 4-D boolean mask and
per-row position ids, so any family whose attention goes through that hook (Llama,
Qwen2, Mistral, ...) is served without model-specific code.

Why nothing from a hub: models load only from local directories (``gs://`` and
``file://`` URIs are copied into a local cache first), with the hub switched off before
``transformers`` is imported; ``transformers`` costs seconds to import, so it is imported
only here and only when ``policy.model`` is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolloutrun_runtime.policy.hf_files import (
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_FILES,
    HFModelError,
    local_model_dir,
)

__all__ = ["HFCausalLM", "HFModelError", "build_hf_model", "export_hf", "offline_transformers"]


def offline_transformers() -> Any:
    """``transformers``, imported with every hub access switched off."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


# ------------------------------------------------------------------ the model
class _RowCache:
    """The ``Cache`` hook: writes each layer's new keys/values at per-row positions into
    the engine's buffer and returns the keys/values every row may attend to."""

    def __init__(
        self, buffer: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, span: int
    ) -> None:
        self.layers: list[Any] = []  # no HF-managed layers: masks come prepared (4-D)
        self.buffer, self.rows, self.positions, self.span = buffer, rows, positions, span

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.buffer[layer_idx, 0], self.buffer[layer_idx, 1]
        # key [n, kv_heads, S, Dh] -> cache[rows, :, positions] takes [n, S, kv_heads, Dh].
        keys[self.rows, :, self.positions] = key.transpose(1, 2).to(keys.dtype)
        values[self.rows, :, self.positions] = value.transpose(1, 2).to(values.dtype)
        return keys[:, :, : self.span], values[:, :, : self.span]


@lru_cache(maxsize=1)
def _row_cache_class() -> type:
    """``_RowCache`` as a ``transformers`` ``Cache`` (made once, after the lazy import)."""
    cache_utils = offline_transformers().cache_utils
    return type("RowCache", (_RowCache, cache_utils.Cache), {})


class HFCausalLM(nn.Module):
    """An ``AutoModelForCausalLM`` with the built-in model's surface; see the module doc."""

    def __init__(self, lm: Any, max_seq_len: int) -> None:
        super().__init__()
        self.lm: Any = lm
        config: Any = lm.config
        self.vocab_size = int(config.vocab_size)
        self.max_seq_len = max_seq_len
        self.n_layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm(input_ids=input_ids, use_cache=False).logits
        return logits

    def new_cache(
        self, rows: int, device: torch.device, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """An empty KV buffer [layers, 2, rows, kv_heads, max_seq_len, head_dim]."""
        dtype = dtype or next(self.parameters()).dtype
        shape = (self.n_layers, 2, rows, self.kv_heads, self.max_seq_len, self.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype)

    def forward_cached(
        self, input_ids: torch.Tensor, start: torch.Tensor, cache: torch.Tensor
    ) -> torch.Tensor:
        """As ``TinyCausalLM.forward_cached``: append ``input_ids`` [n,S] at offsets
        ``start`` [n] to ``cache`` and return logits [n,S,V]."""
        from rolloutrun_runtime.policy.model import cache_geometry

        positions, span, rows, mask = cache_geometry(input_ids, start, self.max_seq_len)
        row_cache = _row_cache_class()(cache, rows, positions, span)
        out = self.lm(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            cache=row_cache,
            use_cache=True,
        )
        logits: torch.Tensor = out.logits
        return logits

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the Hugging Face names (without this wrapper's ``lm.``)."""
        return dict(self.lm.state_dict())


def build_hf_model(
    uri: str,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> HFCausalLM:
    """The model of ``policy.model`` on ``device`` in ``dtype`` (torch's RNG untouched).

    ``weights`` (an ``HFCausalLM`` state dict, as the trainer's model gives it): the model
    holds copies of them and reads only the directory's ``config.json``, never its
    ``*.safetensors``. Why: a generation engine always installs the weights it is handed
    (the trainer's, or a refit's), so reading the model's own was a whole second read of
    the weights at every engine start, and on a ``gs://`` model a download per worker pod.
    """
    transformers = offline_transformers()
    directory = local_model_dir(uri, weights=weights is None)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_seq_len > int(limit):
        raise HFModelError(
            f"policy.maxSeqLen {max_seq_len} exceeds the model's max_position_embeddings {limit}"
        )
    with torch.random.fork_rng(devices=[]):
        try:
            if weights is None:
                lm = transformers.AutoModelForCausalLM.from_pretrained(
                    directory, dtype=dtype, attn_implementation="sdpa", local_files_only=True
                )
            else:
                lm = _around_weights(transformers, config, weights, dtype)
        except ValueError as error:
            raise HFModelError(f"policy.model {uri}: {error}") from error
    return HFCausalLM(lm, max_seq_len).to(device)


def _around_weights(
    transformers: Any, config: Any, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> Any:
    """``config``'s causal LM holding copies of ``weights`` (no initialisation drawn, no
    weight file read). Copies: ``from_pretrained`` would otherwise keep the very tensors it
    is handed, and the engine's template would share (and freeze) the trainer's parameters."""
    try:
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"no causal LM class for a {type(config).__name__}") from None
    own = {_hf_name(name): tensor.detach().clone() for name, tensor in weights.items()}
    return model_class.from_pretrained(
        None, config=config, state_dict=own, dtype=dtype, attn_implementation="sdpa"
    )


def _hf_name(name: str) -> str:
    """A wrapper state-dict name under the Hugging Face model's own (``lm.`` dropped)."""
    return name[len("lm.") :] if name.startswith("lm.") else name


def export_hf(model: HFCausalLM, source_uri: str, out: Path) -> list[Path]:
    """Write ``model`` in the Hugging Face layout (config, safetensors, tokenizer) to ``out``.
    Only the source's tokenizer files are copied (its weights are never read: a ``gs://``
    model is not downloaded again at the end of a run)."""
    source = local_model_dir(source_uri, weights=False)
    out.mkdir(parents=True, exist_ok=True)
    model.lm.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILES, SPECIAL_TOKENS_MAP_FILE):
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())
    return sorted(p for p in out.iterdir() if p.is_file())

"""Hugging Face causal LMs as the policy: a model directory, its tokenizer, its KV cache.

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

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Files a model directory must hold (and at least one ``*.safetensors``).
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
#: Where ``gs://`` model directories are copied (one sub-directory per URI).
MODEL_CACHE_ENV = "ROLLOUTRUN_MODEL_CACHE"
_COMPLETE = ".complete"


class HFModelError(ValueError):
    """A model directory that cannot be used (missing files, an unsupported config)."""


def offline_transformers() -> Any:
    """``transformers``, imported with every hub access switched off."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


# ------------------------------------------------------------------ the model directory
def _cache_root() -> Path:
    root = os.environ.get(MODEL_CACHE_ENV)
    return Path(root) if root else Path(tempfile.gettempdir()) / "rolloutrun-models"


def _copy_from_storage(uri: str, only: Sequence[str] | None) -> Path:
    """Copy the objects under ``uri`` (``gs://``) into the local model cache, once."""
    from rolloutrun_runtime.storage import open_storage

    tag = hashlib.sha256(f"{uri}|{only}".encode()).hexdigest()[:16]
    target = _cache_root() / tag
    if (target / _COMPLETE).exists():
        return target
    storage = open_storage(uri)
    keys = [k for k in storage.list("") if "/" not in k]
    if only is not None:
        keys = [k for k in keys if k in only]
    if not keys:
        raise HFModelError(f"policy.model {uri} holds no files")
    partial = Path(tempfile.mkdtemp(prefix=f"{tag}.", dir=_ensure(target.parent)))
    for key in keys:
        storage.download_file(key, partial / key)
    (partial / _COMPLETE).write_text(uri + "\n")
    try:
        partial.rename(target)
    except OSError:  # another process finished first: use its copy
        pass
    return target


def _ensure(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def model_dir_problem(directory: Path, *, tokenizer_only: bool = False) -> str | None:
    """What a model directory lacks, or None when it holds a model."""
    if not directory.is_dir():
        return f"{directory} is not a directory"
    needed = [TOKENIZER_FILE] if tokenizer_only else [CONFIG_FILE, TOKENIZER_FILE]
    missing = [name for name in needed if not (directory / name).is_file()]
    if not tokenizer_only and not any(directory.glob("*.safetensors")):
        missing.append("*.safetensors")
    return f"{directory} lacks {', '.join(missing)}" if missing else None


def local_model_dir(uri: str, *, tokenizer_only: bool = False) -> Path:
    """The local directory of ``policy.model`` (a path, ``file://`` or ``gs://``)."""
    if uri.startswith("gs://"):
        directory = _copy_from_storage(uri, list(TOKENIZER_FILES) if tokenizer_only else None)
    elif uri.startswith("file://"):
        directory = Path(uri[len("file://") :])
    elif "://" in uri:
        raise HFModelError(f"policy.model {uri!r}: only a directory, file:// or gs:// is read")
    else:
        directory = Path(uri)
    problem = model_dir_problem(directory, tokenizer_only=tokenizer_only)
    if problem:
        raise HFModelError(f"policy.model {uri}: {problem}")
    return directory


# ------------------------------------------------------------------ the tokenizer
class HFTokenizer:
    """``tokenizer.json`` with the built-in tokenizer's surface (ids, encode, decode)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        settings_path = directory / TOKENIZER_CONFIG_FILE
        settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        self.chat_template: str | None = settings.get("chat_template")
        eos = self._special(settings, "eos_token")
        if eos is None:
            raise HFModelError(f"{directory}: the tokenizer names no eos_token")
        self.eos_id = eos
        bos = self._special(settings, "bos_token")
        pad = self._special(settings, "pad_token")
        # A model without BOS (Qwen2) starts its prompts after an end-of-text token.
        self.bos_id = bos if bos is not None else eos
        self.pad_id = pad if pad is not None else eos
        self._special_ids = {self.eos_id, self.bos_id, self.pad_id}

    def _special(self, settings: dict[str, Any], name: str) -> int | None:
        token = settings.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        return self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return str(self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=skip_special))

    def strip_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        ids = list(ids)
        if self.eos_id in ids:
            return ids[: ids.index(self.eos_id)], True
        return ids, False


@lru_cache(maxsize=8)
def load_tokenizer(uri: str) -> HFTokenizer:
    """The tokenizer of ``policy.model`` (read once per process)."""
    return HFTokenizer(local_model_dir(uri, tokenizer_only=True))


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
        from rolloutrun_runtime.policy.model import ModelError

        batch, length = input_ids.shape
        positions = start[:, None] + torch.arange(length, device=input_ids.device)[None, :]
        span = int(positions.max()) + 1
        if span > self.max_seq_len:
            raise ModelError(f"sequence reaches {span} tokens, over max_seq_len {self.max_seq_len}")
        rows = torch.arange(batch, device=input_ids.device)[:, None]
        keys = torch.arange(span, device=input_ids.device)
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [n,1,S,span]
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
    uri: str, max_seq_len: int, device: torch.device, dtype: torch.dtype
) -> HFCausalLM:
    """The model of ``policy.model`` on ``device`` in ``dtype`` (torch's RNG untouched)."""
    transformers = offline_transformers()
    directory = local_model_dir(uri)
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_seq_len > int(limit):
        raise HFModelError(
            f"policy.maxSeqLen {max_seq_len} exceeds the model's max_position_embeddings {limit}"
        )
    with torch.random.fork_rng(devices=[]):
        try:
            lm = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=dtype, attn_implementation="sdpa", local_files_only=True
            )
        except ValueError as error:
            raise HFModelError(f"policy.model {uri}: {error}") from error
    return HFCausalLM(lm, max_seq_len).to(device)


def export_hf(model: HFCausalLM, source_uri: str, out: Path) -> list[Path]:
    """Write ``model`` in the Hugging Face layout (config, safetensors, tokenizer) to ``out``."""
    source = local_model_dir(source_uri)
    out.mkdir(parents=True, exist_ok=True)
    model.lm.save_pretrained(out, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json"):
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())
    return sorted(p for p in out.iterdir() if p.is_file())

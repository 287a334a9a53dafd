"""A Hugging Face model directory and its tokenizer, without torch or transformers.

Why apart from ``hf.py``: the Gym only tokenizes (prompts in, the model's text out), and
must not pay for importing torch or transformers to do so; the trainer and the generation
engine build the model from the same directory through ``hf.py``. Models are read only from
a local directory or a ``file://``/``gs://`` URI (``gs://`` copied into a local cache
first), never from a hub.
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

from rolloutrun_runtime.contract.model_dir import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    model_dir_problem,
)

__all__ = [
    "CONFIG_FILE",
    "GENERATION_CONFIG_FILE",
    "MODEL_CACHE_ENV",
    "PROMPT_FILES",
    "SPECIAL_TOKENS_MAP_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "TOKENIZER_FILES",
    "HFModelError",
    "HFTokenizer",
    "config_stop_ids",
    "load_tokenizer",
    "local_model_dir",
    "model_dir_problem",
]

TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
#: What the Gym reads (a ``gs://`` model copies only these): the tokenizer, and the
#: configs naming the stop tokens (optional).
PROMPT_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG_FILE, CONFIG_FILE)
#: Copied beside exported weights when the source has it (older tokenizers' special tokens).
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
#: What a model built around given weights reads (an engine), or exports beside its own.
MODEL_FILES_BUT_WEIGHTS = (*PROMPT_FILES, SPECIAL_TOKENS_MAP_FILE)
#: Where ``gs://`` model directories are copied (one sub-directory per URI).
MODEL_CACHE_ENV = "ROLLOUTRUN_MODEL_CACHE"
_COMPLETE = ".complete"


class HFModelError(ValueError):
    """A model directory that cannot be used (missing files, an unsupported config)."""


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


def _files_needed(tokenizer_only: bool, weights: bool) -> list[str] | None:
    """Which files of a ``gs://`` model a reader copies (None: all of them)."""
    if tokenizer_only:
        return list(PROMPT_FILES)
    return None if weights else list(MODEL_FILES_BUT_WEIGHTS)


def local_model_dir(uri: str, *, tokenizer_only: bool = False, weights: bool = True) -> Path:
    """The local directory of ``policy.model`` (a path, ``file://`` or ``gs://``).

    ``tokenizer_only`` (the Gym) and ``weights`` False (a model built around weights it is
    given: the generation engine) need only the tokenizer and the configs, so a ``gs://``
    model copies only those, never the weights."""
    if uri.startswith("gs://"):
        directory = _copy_from_storage(uri, _files_needed(tokenizer_only, weights))
    elif uri.startswith("file://"):
        directory = Path(uri[len("file://") :])
    elif "://" in uri:
        raise HFModelError(f"policy.model {uri!r}: only a directory, file:// or gs:// is read")
    else:
        directory = Path(uri)
    problem = model_dir_problem(directory, tokenizer_only=tokenizer_only, weights=weights)
    if problem:
        raise HFModelError(f"policy.model {uri}: {problem}")
    return directory


# ------------------------------------------------------------------ the tokenizer
class HFTokenizer:
    """``tokenizer.json`` with the built-in tokenizer's surface (ids, encode, decode)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        path = directory / TOKENIZER_FILE
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the tokenizers library raises a bare Exception
            raise HFModelError(f"{path}: not a readable tokenizer: {error}") from error
        settings_path = directory / TOKENIZER_CONFIG_FILE
        try:
            settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        except ValueError as error:
            raise HFModelError(f"{settings_path}: not valid JSON: {error}") from error
        self.chat_template: str | None = settings.get("chat_template")
        #: The named special tokens as text (what chat templates see as ``bos_token``...).
        self.special_tokens = {
            name: token.get("content") if isinstance(token, dict) else token
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if isinstance(token := settings.get(name), str | dict)
        }
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
        #: Every token that ends a turn: ``eos_token`` and the ``eos_token_id`` values of
        #: ``generation_config.json`` and ``config.json`` (an int or a list: Llama 3 and
        #: Qwen2 instruct models end turns with more than one token).
        self.stop_ids = frozenset({eos, *config_stop_ids(directory)})

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

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: BOS, then ``text`` raw (``ChatTemplateTokenizer`` renders it)."""
        return [self.bos_id, *self.encode(text)]

    def strip_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The ids before the first stop token, and whether one was there."""
        ids = list(ids)
        for index, token in enumerate(ids):
            if token in self.stop_ids:
                return ids[:index], True
        return ids, False


def config_stop_ids(directory: Path) -> list[int]:
    """The ``eos_token_id`` values of ``generation_config.json`` and ``config.json``."""
    found: list[int] = []
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as error:
            raise HFModelError(f"{path}: not a JSON object ({error})") from error
        values = value if isinstance(value, list) else [value]
        for item in values:
            if item is None:
                continue
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise HFModelError(f"{path}: eos_token_id {value!r} is not a token id or a list")
            found.append(item)
    return found


@lru_cache(maxsize=8)
def load_tokenizer(uri: str) -> HFTokenizer:
    """The tokenizer of ``policy.model`` (read once per process)."""
    return HFTokenizer(local_model_dir(uri, tokenizer_only=True))

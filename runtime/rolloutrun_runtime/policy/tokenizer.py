"""A character tokenizer over one small fixed charset shared by every task.

Why characters: the tasks speak in digits, a few letters and punctuation, so a character
vocabulary keeps the embedding table tiny and makes every token id meaningful to a human
reading a trace. One charset for all tasks means a checkpoint's vocabulary never depends on
the task it was trained on, and the generation server needs no task knowledge.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rolloutrun_runtime.contract.run_config import PolicyConfig

#: Printable characters the tasks use, in token-id order after the special tokens.
CHARSET = "0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>?:;,. _\n"

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class TokenizerError(ValueError):
    """Text or token ids outside the tokenizer's vocabulary."""


class CharTokenizer:
    """Maps characters to ids; ids 0..2 are ``<pad>``, ``<bos>`` and ``<eos>``."""

    def __init__(self, charset: str = CHARSET) -> None:
        if len(set(charset)) != len(charset):
            raise TokenizerError("tokenizer charset has duplicate characters")
        self.specials = (PAD, BOS, EOS)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.charset = charset
        self._ids = {char: index + len(self.specials) for index, char in enumerate(charset)}
        self._chars = dict(enumerate(self.specials)) | {v: k for k, v in self._ids.items()}
        self.stop_ids = frozenset({self.eos_id})

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.charset)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added); unknown characters raise."""
        try:
            return [self._ids[char] for char in text]
        except KeyError as error:
            raise TokenizerError(
                f"character {error.args[0]!r} is not in the tokenizer charset {self.charset!r}"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's token ids: ``<bos>`` then ``text``."""
        return [self.bos_id, *self.encode(text)]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special`` is false."""
        out: list[str] = []
        for token in ids:
            try:
                char = self._chars[int(token)]
            except KeyError:
                raise TokenizerError(
                    f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})"
                ) from None
            if int(token) < len(self.specials):
                if not skip_special:
                    out.append(char)
                continue
            out.append(char)
        return "".join(out)

    def strip_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The ids before the first ``<eos>``, and whether one was there."""
        ids = list(ids)
        if self.eos_id in ids:
            return ids[: ids.index(self.eos_id)], True
        return ids, False


#: The one tokenizer every part of the runtime uses.
TOKENIZER = CharTokenizer()


class PolicyTokenizer(Protocol):
    """What the runtime asks of a tokenizer (the built-in one or a model directory's)."""

    pad_id: int
    bos_id: int
    eos_id: int
    #: Every token id that ends a model turn (``eos_id`` among them).
    stop_ids: frozenset[int]

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """The one place a prompt becomes token ids (a BOS and the raw text, or the model's
        chat template with ``policy.chatTemplate``)."""
        ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def strip_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]: ...


def policy_tokenizer(cfg: PolicyConfig) -> PolicyTokenizer:
    """The policy's tokenizer: ``policy.model``'s ``tokenizer.json`` (its prompts through the
    model's chat template with ``policy.chatTemplate``), or the built-in one.
    The tokenizer half of the model-family seam (``family.py``), kept free of torch so the
    Gym, which only tokenizes, never imports it."""
    if cfg.model is None:
        return TOKENIZER
    from rolloutrun_runtime.policy.hf_files import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    if not cfg.chat_template:
        return tokenizer
    from rolloutrun_runtime.policy.chat import ChatTemplateTokenizer

    return ChatTemplateTokenizer(tokenizer, cfg.model)

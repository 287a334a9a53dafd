"""Prompts through a model's chat template (``policy.chatTemplate``).

Why: an instruction-tuned model (Qwen2, Llama 3 instruct) expects its prompts wrapped in
the chat markup its ``tokenizer_config.json`` carries as ``chat_template`` (Jinja), not raw
text. With ``policy.chatTemplate: true`` every prompt is rendered as one user message with
``add_generation_prompt=True`` (as ``transformers``' ``apply_chat_template`` does) and the
rendered text is tokenized without a BOS of ours: the template places the model's special
tokens itself. Why here and not ``transformers``: the Gym only tokenizes and must not import
torch or ``transformers``; ``jinja2``'s sandbox renders a template from a model directory
without letting it reach Python objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any, NoReturn

from rolloutrun_runtime.policy.hf_files import HFModelError, HFTokenizer

__all__ = ["ChatTemplateTokenizer", "render_chat_prompt"]


def _raise_exception(message: str) -> NoReturn:
    """The ``raise_exception`` helper Hugging Face templates call on bad input."""
    raise HFModelError(f"the chat template refused the prompt: {message}")


@lru_cache(maxsize=8)
def _compiled(template: str) -> Callable[..., str]:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # As transformers renders templates: loop controls, and tojson without HTML escaping.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template).render
    except TemplateError as error:
        raise HFModelError(f"the chat template does not parse: {error}") from error


def render_chat_prompt(template: str, text: str, specials: dict[str, Any] | None = None) -> str:
    """``text`` as one user message, rendered by ``template`` with a generation prompt."""
    from jinja2.exceptions import TemplateError

    try:
        return _compiled(template)(
            messages=[{"role": "user", "content": text}],
            add_generation_prompt=True,
            **(specials or {}),
        )
    except TemplateError as error:
        raise HFModelError(f"the chat template failed: {error}") from error


class ChatTemplateTokenizer:
    """An ``HFTokenizer`` whose prompts go through the model's chat template."""

    def __init__(self, base: HFTokenizer, where: str) -> None:
        if not base.chat_template:
            raise HFModelError(
                f"policy.chatTemplate is true but policy.model {where} has no chat_template "
                "in tokenizer_config.json"
            )
        self.base = base
        self.template: str = base.chat_template
        self.pad_id, self.bos_id, self.eos_id = base.pad_id, base.bos_id, base.eos_id
        self.stop_ids = base.stop_ids
        # Templates may name the special tokens (Llama 3: ``{{ bos_token }}``), as
        # tokenizer_config.json names them (a model without a BOS leaves it undefined).
        self.specials: dict[str, Any] = dict(base.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        return self.base.encode(render_chat_prompt(self.template, text, self.specials))

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.base.decode(ids, skip_special)

    def strip_eos(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        return self.base.strip_eos(ids)

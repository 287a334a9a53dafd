"""The policy section of RunConfig (``spec.run.policy``): the built-in model or a Hugging
Face causal LM, its dtype and device.

Why a module of its own: ``run_config.py`` holds every other section and stays under 600
lines; the names are re-exported there, so callers keep importing them from ``run_config``.
Imports only pydantic and the standard library (the operator image has no torch).
"""

from __future__ import annotations

import enum

from pydantic import ConfigDict, Field, model_validator

from rolloutrun_runtime.contract.config_base import ConfigSection as _Model
from rolloutrun_runtime.contract.field_rules import FieldRule, cel_rules

#: Every attention head gets dModel/nHeads dimensions.
HEADS_DIVIDE_WIDTH = FieldRule(
    rule="self.dModel % self.nHeads == 0",
    message="policy.dModel must be divisible by policy.nHeads",
)

#: The built-in model has no chat template.
CHAT_TEMPLATE_NEEDS_MODEL = FieldRule(
    rule="!self.chatTemplate || has(self.model)",
    message="policy.chatTemplate needs policy.model (the built-in model has no chat template)",
)


class Device(enum.StrEnum):
    """Where the policy's tensors live."""

    AUTO = "auto"
    """CUDA when present, else CPU."""
    CPU = "cpu"
    CUDA = "cuda"


class PolicyDtype(enum.StrEnum):
    """The dtype of the policy's weights."""

    AUTO = "auto"
    """bfloat16 on CUDA, float32 on CPU."""
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class PolicyConfig(_Model):
    """The policy: the built-in small causal transformer over the tasks' character
    vocabulary, or a Hugging Face causal LM (``model``)."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(HEADS_DIVIDE_WIDTH, CHAT_TEMPLATE_NEEDS_MODEL)
    )

    d_model: int = Field(64, ge=8, le=4096, description="Transformer hidden size.")
    n_layers: int = Field(2, ge=1, le=64, description="Number of transformer blocks.")
    n_heads: int = Field(4, ge=1, le=64, description="Attention heads per block.")
    max_seq_len: int = Field(
        128, ge=16, le=8192, description="Longest token sequence (prompt plus all turns)."
    )
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Sampling temperature for rollouts."
    )
    device: Device = Field(Device.AUTO, description="Device for the policy's tensors.")
    model: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description=(
            "A Hugging Face causal LM: a directory or a file:// or gs:// URI holding "
            "config.json, *.safetensors and tokenizer.json. Unset: the built-in model "
            "(dModel, nLayers, nHeads apply only to it)."
        ),
    )
    dtype: PolicyDtype = Field(
        PolicyDtype.AUTO,
        description="Dtype of the policy's weights (auto: bfloat16 on CUDA, float32 on CPU).",
    )

    chat_template: bool = Field(
        False,
        description=(
            "Render each prompt as one user message with the model's chat template "
            "(tokenizer_config.json chat_template, add_generation_prompt) before tokenizing. "
            "Needs model. False: prompts are tokenized raw after a BOS."
        ),
    )

    @model_validator(mode="after")
    def _chat_template_needs_model(self) -> PolicyConfig:
        if self.chat_template and self.model is None:
            raise ValueError(CHAT_TEMPLATE_NEEDS_MODEL.message)
        return self

    @model_validator(mode="after")
    def _heads_divide_width(self) -> PolicyConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"{HEADS_DIVIDE_WIDTH.message} (dModel {self.d_model}, nHeads {self.n_heads})"
            )
        return self

"""``task.dataset``: a user's prompt file and its field mapping (part of ``RunConfig``).

Why apart from ``run_config.py``: the prompt set is a section of its own (read by the
trainer, :mod:`rolloutrun_runtime.prompt_data`; carried to the user's environment server in
``/run``, docs/environment-contract.md), and ``run_config.py`` stays under 600 lines.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import Field, StringConstraints

from rolloutrun_runtime.contract.config_base import ConfigSection


class DatasetFormat(enum.StrEnum):
    """How a prompt file is read."""

    AUTO = "auto"
    """From the file name: ``.jsonl``/``.json`` (one JSON object a line) or ``.parquet``."""
    JSONL = "jsonl"
    PARQUET = "parquet"


#: A prompt file: an absolute path, ``file:///...``, ``gs://bucket/...``, or a key relative
#: to the run's storage (``data/train.jsonl``).
DATASET_URI_PATTERN = (
    r"^(file:///[^\s]+|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]/[^\s]+|/[^\s]+|[A-Za-z0-9_][^\s:]*)$"
)
#: A field name of a prompt record.
FieldName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[^\s]+$")]


class DatasetConfig(ConfigSection):
    """A prompt set in a JSONL or Parquet file, and which fields are what.

    Row ``i`` of the file is prompt id ``i``: the epoch permutation, the cursor, the spare
    pool and the ledger keep ids as with the built-in tasks; ``POST /run`` carries the row's
    prompt, answer and metadata to the environment server (``RunRequest.prompt``)."""

    uri: str = Field(
        min_length=1,
        max_length=2048,
        pattern=DATASET_URI_PATTERN,
        description=(
            "The prompt file: gs://bucket/path, file:///path, /path, or a key relative to "
            "the run's storage (spec.storage.uri), such as data/train.jsonl."
        ),
    )
    format: DatasetFormat = Field(
        DatasetFormat.AUTO, description="jsonl, parquet, or auto (from the file name)."
    )
    prompt_field: FieldName = Field("prompt", description="The field holding the prompt text.")
    answer_field: FieldName | None = Field(
        None, description="The field holding the reference answer (optional; any JSON value)."
    )
    metadata_fields: list[FieldName] = Field(
        default_factory=list,
        max_length=64,
        description="Further fields passed to the environment as the prompt's metadata.",
    )

"""Restore bodies that fit the Gym's request limit.

Why: a Gym refuses a body over ``gym.requestMaxBytes`` (1 MiB by default) with a 413 before
reading it, and a snapshot of many long episodes easily holds several MiB of records; one
refused body used to restart every episode of the replica from turn 0. The trainer therefore
packs each replica's records into chunks under the limit (the Gym installs them under one
restore id, so the restore stays all or nothing) and refuses only a record that alone does
not fit, naming the episode and the sizes. Pure: the sizes are those of the JSON the client
sends (``json.dumps`` with its default separators, as aiohttp serializes a ``json=`` body).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Bytes left free in every body for what the estimate does not see (number formatting).
BODY_MARGIN_BYTES = 512

#: What a record adds to a JSON list after the first one (aiohttp's ``json.dumps``).
_SEPARATOR_BYTES = len(", ")


def json_size(value: Any) -> int:
    """Bytes of ``value`` as the client's JSON (``ensure_ascii``: one byte a character)."""
    return len(json.dumps(value))


@dataclass(frozen=True)
class OversizedRecord:
    """A record that does not fit one body even alone."""

    record: Mapping[str, Any]
    size: int
    budget: int

    def reason(self, limit: int) -> str:
        return (
            f"its snapshot record is {self.size} bytes, over the {self.budget} bytes a restore "
            f"body leaves for records (gym.requestMaxBytes = {limit} bytes); it restarts from "
            "turn 0"
        )


@dataclass(frozen=True)
class ChunkPlan:
    """The bodies' record lists in order (at least one, maybe empty), and the refused."""

    chunks: list[list[Mapping[str, Any]]]
    oversized: list[OversizedRecord] = field(default_factory=list)


def plan_chunks(
    records: Sequence[Mapping[str, Any]], limit_bytes: int, envelope_bytes: int
) -> ChunkPlan:
    """Pack ``records`` in order into chunks whose bodies stay under ``limit_bytes``.

    ``envelope_bytes`` is the size of the body with no records (ids, deadline, trainer).
    There is always a chunk 0, empty when there are no records: it opens the restore scope.
    """
    budget = limit_bytes - envelope_bytes - BODY_MARGIN_BYTES
    if budget <= 0:
        raise ValueError(
            f"a restore body of {envelope_bytes} bytes without records leaves no room under "
            f"gym.requestMaxBytes = {limit_bytes} bytes"
        )
    chunks: list[list[Mapping[str, Any]]] = []
    oversized: list[OversizedRecord] = []
    current: list[Mapping[str, Any]] = []
    used = 0
    for record in records:
        size = json_size(record)
        if size > budget:
            oversized.append(OversizedRecord(record, size, budget))
            continue
        extra = size + (_SEPARATOR_BYTES if current else 0)
        if current and used + extra > budget:
            chunks.append(current)
            current, extra, used = [], size, 0
        current.append(record)
        used += extra
    if current or not chunks:
        chunks.append(current)
    return ChunkPlan(chunks, oversized)

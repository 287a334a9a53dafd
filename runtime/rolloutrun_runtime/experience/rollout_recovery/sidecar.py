"""The ledger's sidecar: the bytes saved beside the data plane's checkpoint, and their reader.

Why apart from the ledger: the sidecar is a wire format with versions (schema 5 adds the
spare-prompt pool, always present, possibly empty, to schema 4's batch shortfall and sampler
stamping flag) and the data plane's metadata repeats its digest, schema and group count, so
a reader checks the bytes against the checkpoint before it trusts a single record. The
encoding is deterministic JSON (sorted keys, no spaces), so equal ledgers give equal digests.

Schema 6 (rollout snapshots): the file is a small head, schema 5's document with
``groups_chain`` (the chunk list of a :mod:`rolloutrun_runtime.json_chain` chain of the
groups by id, in the ledger's order) in place of ``groups``; a snapshot writes only the
chunk of groups changed since the last one. The head's digest covers each chunk's sha256,
so the checkpoint's facts still pin every byte; the reader takes the chunks beside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from rolloutrun_runtime.contract.layout import (
    LEDGER_CHAIN_SCHEMA_VERSION,
    READABLE_LEDGER_SCHEMA_VERSIONS,
)
from rolloutrun_runtime.cow import CowView
from rolloutrun_runtime.experience.rollout_recovery.ledger import RecoveryLedger
from rolloutrun_runtime.experience.rollout_recovery.records import (
    LedgerSidecarError,
    PromptGroupRecord,
    PromptRef,
    _strict,
    encode_json,
)
from rolloutrun_runtime.json_chain import ChainError, ChainStage, read_chain


@dataclass(frozen=True)
class LedgerSidecar:
    """Serialized ledger bytes and the facts the data-plane metadata repeats."""

    data: bytes
    sha256: str
    schema_version: int
    group_count: int

    def metadata(self) -> dict[str, Any]:
        """What the data-plane checkpoint metadata records about this sidecar."""
        return {
            "rollout_recovery_schema": self.schema_version,
            "rollout_recovery_sha256": self.sha256,
            "rollout_recovery_groups": self.group_count,
        }


@dataclass
class RecoveredLedger:
    """What a sidecar holds: the ledger and the rollout state saved beside it."""

    ledger: RecoveryLedger
    schema_version: int
    spare_prompts: list[PromptRef] | None
    batch_shortfall: dict[int, int]
    sampler_stamps_target_steps: bool


def encode_sidecar(document: Mapping[str, Any]) -> LedgerSidecar:
    """Serialize a :meth:`RecoveryLedger.sidecar_document` deterministically, with its sha256."""
    return _sidecar(encode_json(document).encode(), document, len(document["groups"]))


def _sidecar(data: bytes, document: Mapping[str, Any], groups: int) -> LedgerSidecar:
    return LedgerSidecar(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        schema_version=int(document["schema_version"]),
        group_count=groups,
    )


@dataclass(frozen=True)
class SidecarCapture:
    """A sidecar taken under the cut (:meth:`RecoveryLedger.sidecar_capture`): a
    copy-on-write view of each group's JSON text in the ledger's order (the texts are shared
    with the ledger's cache, never copied) and the small rest of the document. Taking it
    costs the groups changed since the previous capture; the view is built when first read,
    after the cut."""

    texts: CowView[str, str | None]
    rest: Mapping[str, Any]
    serialized: int = 0
    """Groups serialized by the capture itself (changed since they were last serialized)."""

    @cached_property
    def fragments(self) -> Mapping[str, str]:
        """Each group's JSON text by group id, in the ledger's order."""
        texts = self.texts.mapping()
        unserialized = [group_id for group_id, text in texts.items() if text is None]
        if unserialized:
            raise LedgerSidecarError(
                f"ledger capture lacks the JSON of {len(unserialized)} groups "
                f"({', '.join(unserialized[:5])}): the capture is incomplete"
            )
        return cast("Mapping[str, str]", texts)

    @property
    def order(self) -> list[str]:
        """The group ids in the ledger's order."""
        return list(self.fragments)

    @property
    def groups(self) -> list[str]:
        """Each group's JSON text, in the ledger's order."""
        return list(self.fragments.values())

    def encode(self) -> LedgerSidecar:
        """The bytes ``encode_sidecar`` gives for the same document, without re-serializing
        the groups: the document's keys in sorted order, the groups' texts joined."""
        fields = {key: encode_json(value) for key, value in self.rest.items()}
        fields["groups"] = "[" + ",".join(self.groups) + "]"
        body = ",".join(f"{encode_json(key)}:{fields[key]}" for key in sorted(fields))
        return _sidecar(("{" + body + "}").encode(), self.rest, len(self.fragments))

    def encode_chained(self, stage: ChainStage) -> LedgerSidecar:
        """The schema-6 head for the groups' chain ``stage`` (staged from :attr:`fragments`)."""
        head = {
            **self.rest,
            "schema_version": LEDGER_CHAIN_SCHEMA_VERSION,
            "groups_chain": stage.head(),
        }
        return _sidecar(encode_json(head).encode(), head, len(self.fragments))

    def document(self) -> dict[str, Any]:
        """The document as fresh dicts, for a caller that edits it before encoding."""
        groups = [json.loads(text) for text in self.groups]
        return {**json.loads(encode_json(self.rest)), "groups": groups}


def chain_keys(data: bytes) -> list[str]:
    """The chunk keys a schema-6 head lists (none for older schemas or unreadable bytes: the
    reader then names the problem)."""
    try:
        document = json.loads(data)
        chain = document.get("groups_chain", []) if isinstance(document, dict) else []
        return [str(record["key"]) for record in chain]
    except (ValueError, TypeError, KeyError):
        return []


def sidecar_document(data: bytes, chunks: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """A sidecar's document with its groups (a schema-6 head's chain read from ``chunks``,
    key -> bytes): ``LedgerSidecarError`` naming what is missing or malformed."""
    try:
        document = json.loads(data)
    except ValueError as error:
        raise LedgerSidecarError(f"recovery sidecar is not valid JSON: {error}") from error
    if not isinstance(document, dict):
        raise LedgerSidecarError("recovery sidecar must be a JSON object")
    if document.get("schema_version") != LEDGER_CHAIN_SCHEMA_VERSION:
        return document
    if "groups" in document or "groups_chain" not in document:
        raise LedgerSidecarError("recovery sidecar schema 6 holds groups_chain, not groups")
    try:
        groups = read_chain(document.pop("groups_chain"), chunks or {}, "recovery sidecar")
    except ChainError as error:
        raise LedgerSidecarError(str(error)) from error
    for group_id, group in groups.items():
        if not isinstance(group, dict) or group.get("group_id") != group_id:
            raise LedgerSidecarError(f"recovery sidecar chain: group {group_id!r} mislabeled")
    return {**document, "groups": list(groups.values())}


def read_recovery_sidecar(
    data: bytes,
    *,
    expected_sha256: str | None = None,
    expected_schema: int | None = None,
    expected_group_count: int | None = None,
    chunks: Mapping[str, bytes] | None = None,
) -> RecoveredLedger:
    """Parse sidecar bytes (schema 4, 5 or 6, whose chain's chunks are in ``chunks``),
    checking them against the data-plane metadata."""
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise LedgerSidecarError(
            f"recovery sidecar sha256 {digest} does not match the checkpoint's {expected_sha256}"
        )
    document = sidecar_document(data, chunks)
    version = document.get("schema_version")
    if version not in READABLE_LEDGER_SCHEMA_VERSIONS:
        raise LedgerSidecarError(
            f"recovery sidecar schema {version!r} is not readable "
            f"(this runtime reads {READABLE_LEDGER_SCHEMA_VERSIONS})"
        )
    if expected_schema is not None and version != expected_schema:
        raise LedgerSidecarError(
            f"recovery sidecar schema {version} does not match the checkpoint's {expected_schema}"
        )
    keys = {"schema_version", "groups", "batch_shortfall", "sampler_stamps_target_steps"}
    if version >= 5:
        keys.add("spare_prompts")
    fields = _strict(document, "sidecar", keys)
    groups_json = fields["groups"]
    if not isinstance(groups_json, list):
        raise LedgerSidecarError("sidecar.groups must be a list")
    groups = [PromptGroupRecord.from_json(g, f"groups[{i}]") for i, g in enumerate(groups_json)]
    if expected_group_count is not None and len(groups) != expected_group_count:
        raise LedgerSidecarError(
            f"recovery sidecar holds {len(groups)} groups; the checkpoint says "
            f"{expected_group_count}"
        )
    shortfall_json = fields["batch_shortfall"]
    if not isinstance(shortfall_json, dict):
        raise LedgerSidecarError("sidecar.batch_shortfall must be an object")
    spare: list[PromptRef] | None = None
    if version >= 5:
        spare_json = fields["spare_prompts"]
        if not isinstance(spare_json, list):
            raise LedgerSidecarError("sidecar.spare_prompts must be a list")
        spare = [PromptRef.from_json(p, f"spare_prompts[{i}]") for i, p in enumerate(spare_json)]
    return RecoveredLedger(
        ledger=RecoveryLedger._from_groups(groups),
        schema_version=int(version),
        spare_prompts=spare,
        batch_shortfall={int(k): int(v) for k, v in shortfall_json.items()},
        sampler_stamps_target_steps=bool(fields["sampler_stamps_target_steps"]),
    )

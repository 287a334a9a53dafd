"""Reading the Gym's side-effect records: audit files and ``gym-audit/`` objects.

Why apart from the rest of the durable state: the Gym replicas write these records, not the
trainer, in two layouts (per-replica ``gym-*.audit.jsonl`` files next to the run's logs,
and one object per effect under the run's storage), and a record that cannot be read may
hide a duplicate, so every unreadable one is named (:class:`TornRecords`) rather than
skipped. An audit file's unterminated last line is a torn tail: tolerated, not applied.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rolloutrun_runtime.audit.state import AuditError, SideEffect, TornRecords
from rolloutrun_runtime.contract.layout import GYM_AUDIT_GLOB, GYM_AUDIT_PREFIX

logger = logging.getLogger(__name__)


def parse_side_effects(lines: Iterable[str], source: str) -> tuple[list[SideEffect], int]:
    """A Gym audit file's lines; a torn (unparseable) line is counted, not trusted."""
    effects: list[SideEffect] = []
    torn = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            effects.append(
                SideEffect(
                    source=source,
                    rollout_id=str(entry["rollout_id"]),
                    attempt=int(entry["attempt"]),
                    revision=int(entry["revision"]),
                    turn=int(entry.get("turn", 0)),
                )
            )
        except (ValueError, KeyError, TypeError):
            torn += 1
    return effects, torn


def parse_audit_file(text: str, source: str) -> tuple[list[SideEffect], TornRecords]:
    """An audit file's records; each unreadable line is named ``<source>:<line>``, as a
    torn tail when it is the unterminated last one (not counted as applied: the writer
    never finished it, and cuts it when it reopens the file)."""
    *complete, tail = text.split("\n")
    effects: list[SideEffect] = []
    torn = TornRecords()
    for number, line in enumerate(complete, 1):
        parsed, bad = parse_side_effects([line], source)
        effects += parsed
        if bad:
            torn.places.append(f"{source}:{number}")
    if tail.strip():
        torn.tails.append(f"{source}:{len(complete) + 1}")
    return effects, torn


def parse_side_effect_object(raw: bytes, key: str, source: str) -> SideEffect | None:
    """One ``--audit-uri`` object at ``key`` (``<rollout>/<revision>.json``, or the older
    ``<instance>/<rollout>/<revision>.json``; the JSON of one audit line); ``None`` if torn.
    An object whose content names another ``(rollout_id, revision)`` than its key is not
    trusted either.
    """
    from rolloutrun_runtime.environments.gym.effects import parse_effect_key

    parsed = parse_effect_key(key)
    effects, torn = parse_side_effects([raw.decode("utf-8", errors="replace")], source)
    if torn or len(effects) != 1 or parsed is None:
        return None
    (effect,) = effects
    if (effect.rollout_id, effect.revision) != parsed[1:]:
        return None
    return effect


def load_side_effects(
    run_dir: Path | None, storage: Any, *, threads: int = 16
) -> tuple[list[SideEffect], TornRecords]:
    """Side effects from ``RUN_DIR/gym-*.audit.jsonl`` and from the storage's objects.

    Without ``run_dir`` (the audit of a storage, as on a cluster) the audit files are the
    storage's ``gym-audit/gym-*.audit.jsonl``, where the Gym pods of a ``file://`` run
    write them.

    ``rolloutrun gym --audit-uri <storage>/gym-audit`` (gs:// cluster runs) writes one
    object per effect at ``gym-audit/<rollout>/<revision>.json`` (older versions:
    ``gym-audit/<instance>/<rollout>/<revision>.json``); they are read in parallel. Returns
    ``(effects, torn)``: an unreadable object counts like a torn line inside a file. A
    storage that cannot be listed is an :class:`AuditError`.
    """
    from concurrent.futures import ThreadPoolExecutor

    from rolloutrun_runtime.environments.gym.effects import parse_effect_key
    from rolloutrun_runtime.storage import StorageError

    effects: list[SideEffect] = []
    torn = TornRecords()
    for name, raw in _audit_files(run_dir, storage):
        lines, bad = parse_audit_file(raw.decode("utf-8", errors="replace"), name)
        effects += lines
        torn.places += bad.places
        torn.tails += bad.tails
    start = len(GYM_AUDIT_PREFIX) + 1
    try:
        keys = [
            key
            for key in storage.list(GYM_AUDIT_PREFIX + "/")
            if parse_effect_key(key[start:]) is not None  # not the file:// audit files
        ]
    except StorageError as error:
        raise AuditError(f"cannot list the Gym side effects: {error}") from error

    def read(key: str) -> SideEffect | None:
        try:
            raw = storage.read_bytes(key)
        except StorageError as error:
            logger.warning("audit counts %s as torn: %s", storage.uri_for(key), error)
            return None
        return parse_side_effect_object(raw, key[start:], key)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for key, effect in zip(keys, pool.map(read, keys), strict=True):
            if effect is None:
                torn.places.append(key)
            else:
                effects.append(effect)
    return effects, torn


def _audit_files(run_dir: Path | None, storage: Any) -> list[tuple[str, bytes]]:
    """``(name, content)`` of each Gym audit file: in ``run_dir``, else in the storage."""
    import fnmatch

    from rolloutrun_runtime.storage import StorageError

    if run_dir is not None:
        return [(p.name, p.read_bytes()) for p in sorted(run_dir.glob(GYM_AUDIT_GLOB))]
    prefix = GYM_AUDIT_PREFIX + "/"
    try:
        keys = [
            key
            for key in storage.list(prefix)
            if "/" not in key[len(prefix) :] and fnmatch.fnmatch(key[len(prefix) :], GYM_AUDIT_GLOB)
        ]
        return [(key[len(prefix) :], storage.read_bytes(key)) for key in sorted(keys)]
    except StorageError as error:
        raise AuditError(f"cannot read the Gym audit files: {error}") from error

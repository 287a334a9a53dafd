"""Where a Gym replica keeps the side effects it applied: an audit file or storage objects.

Why it matters: every side effect is keyed ``(rollout_id, revision)``, the same key across
attempts, and a replica must refuse a revision it already applied, also after the pod that
applied it was replaced. That only holds if the record outlives the pod. Two stores, one
refusal logic (:class:`SideEffectLog`):

* :class:`AuditFileStore` (``rolloutrun gym --audit-file PATH``): one JSON line per effect,
  flushed as written; reopening reloads the highest revision per rollout. For local runs and
  ``file://`` storage on a volume every incarnation mounts.
* :class:`StorageEffectStore` (``--audit-uri URI``, any URI ``open_storage`` opens, also
  ``gs://``): one create-only object per effect at
  ``<instance_id>/<rollout_id>/<revision, 9 digits>.json``, holding the same JSON as an
  audit-file line. The object is written *before* the effect is applied (write-ahead), and
  a create conflict means the revision was already claimed: the storage itself enforces
  "never twice", across pod replacements and against a racing writer. At startup the
  instance's prefix is listed once; the names alone give the highest revision per rollout.

A revision is claimed in memory before its record is written and stays claimed if the write
fails or the ``/run`` is cancelled while it is in flight: its fate is unknown, so it counts
as applied. The effect itself is applied only after the write returned, which makes this
at-most-once: a claimed but unapplied revision is never applied later (the checkpoint
control plane refuses to continue an episode whose rollout applied past it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from rolloutrun_runtime.storage import (
    CheckpointStorage,
    ObjectExistsError,
    StorageError,
    join_key,
)
from rolloutrun_runtime.storage.keys import key_problem

if TYPE_CHECKING:
    from rolloutrun_runtime.environments.gym.episode import Episode

logger = logging.getLogger(__name__)

#: Digits of the revision in an effect object's name (zero-padded so names sort by revision).
REVISION_DIGITS = 9
#: Threads that write effect records: one write per episode at a time, each a round trip,
#: so more threads than cores (the event loop's default pool has cores + 4).
WRITE_THREADS = 32
#: Log loading progress every this many effect objects.
LOAD_PROGRESS_EVERY = 100_000
#: A rollout id may start with '.', which is not a safe key part ('.', '..', reserved names);
#: rollout ids never contain '%', so this escape is unambiguous.
_LEADING_DOT = "%2E"


class SideEffectReplayError(Exception):
    """A side effect whose ``(rollout_id, revision)`` was already applied: refused."""


class SideEffectStorageError(Exception):
    """A side effect's record could not be written: the effect was not applied."""


class EffectStore(Protocol):
    """Durable record of applied side effects, one entry per ``(rollout_id, revision)``."""

    #: Whether :meth:`write` may block on I/O long enough to stall the event loop.
    blocking: bool

    def load(self) -> dict[str, int]:
        """The highest recorded revision per rollout (read once, at startup)."""
        ...

    def where(self, entry: dict[str, Any]) -> str:
        """The file or object that holds ``entry`` (for messages)."""
        ...

    def write(self, entry: dict[str, Any]) -> None:
        """Record ``entry`` durably; ``ObjectExistsError`` if its key is already recorded."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- audit file
class AuditFileStore:
    """Effects as JSON lines appended to one local file (see the module doc)."""

    blocking = False  # a local append and flush

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None
        self._revisions = self._read() if path.exists() else {}
        self._file = path.open("a", encoding="utf-8")

    def _read(self) -> dict[str, int]:
        revisions: dict[str, int] = {}
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                entry = json.loads(line)
                rollout_id, revision = str(entry["rollout_id"]), int(entry["revision"])
            except (ValueError, KeyError, TypeError):
                logger.warning("audit file %s: skipping unreadable line %d", self.path, number)
                continue
            revisions[rollout_id] = max(revisions.get(rollout_id, 0), revision)
        return revisions

    def load(self) -> dict[str, int]:
        return dict(self._revisions)

    def where(self, entry: dict[str, Any]) -> str:
        return str(self.path)

    def write(self, entry: dict[str, Any]) -> None:
        if self._file is None:
            raise StorageError(str(self.path), "the audit file is closed")
        try:
            self._file.write(json.dumps(entry, sort_keys=True) + "\n")
            self._file.flush()
        except OSError as error:
            raise StorageError(str(self.path), f"cannot append: {error}") from error

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --------------------------------------------------------------------------- storage
def rollout_key_part(rollout_id: str) -> str:
    """``rollout_id`` as one key part (a leading '.' escaped); see :func:`parse_effect_key`."""
    return _LEADING_DOT + rollout_id[1:] if rollout_id.startswith(".") else rollout_id


def effect_key(instance_id: str, rollout_id: str, revision: int) -> str:
    """``<instance_id>/<rollout_id>/<revision, 9 digits>.json``."""
    return f"{instance_id}/{rollout_key_part(rollout_id)}/{revision:0{REVISION_DIGITS}d}.json"


def parse_effect_key(key: str) -> tuple[str, str, int] | None:
    """``(instance_id, rollout_id, revision)`` of an effect object's key, or ``None``."""
    parts = key.split("/")
    if len(parts) != 3 or not parts[2].endswith(".json"):
        return None
    instance_id, part, name = parts
    digits = name[: -len(".json")]
    if not digits.isdigit() or not part:
        return None
    rollout_id = "." + part[len(_LEADING_DOT) :] if part.startswith(_LEADING_DOT) else part
    return instance_id, rollout_id, int(digits)


def highest_revisions(keys: list[str], instance_id: str, where: str) -> dict[str, int]:
    """The highest revision per rollout among ``instance_id``'s effect ``keys``.

    Only names are used, not contents: an object whose name exists claims its revision even
    if its body is unreadable. Keys that are not effect objects are logged and skipped.
    """
    revisions: dict[str, int] = {}
    skipped = 0
    for count, key in enumerate(keys, 1):
        parsed = parse_effect_key(key)
        if parsed is None or parsed[0] != instance_id:
            skipped += 1
            if skipped <= 5:
                logger.warning("%s: ignoring %r (not a side-effect object)", where, key)
            continue
        _, rollout_id, revision = parsed
        if revision > revisions.get(rollout_id, 0):
            revisions[rollout_id] = revision
        if count % LOAD_PROGRESS_EVERY == 0:
            logger.info("%s: read %d of %d side-effect names", where, count, len(keys))
    if skipped:
        logger.warning("%s: ignored %d objects that are not side effects", where, skipped)
    return revisions


def instance_id_problem(instance_id: str) -> str | None:
    """Why ``instance_id`` cannot name a storage prefix, or ``None``."""
    if "/" in instance_id:
        return "it contains '/'"
    return key_problem(instance_id)


class StorageEffectStore:
    """Effects as create-only objects under ``<storage>/<instance_id>/`` (see the module doc)."""

    blocking = True  # a network round trip on gs://, fsyncs on file://

    def __init__(self, storage: CheckpointStorage, instance_id: str) -> None:
        problem = instance_id_problem(instance_id)
        if problem is not None:
            raise ValueError(f"instance id {instance_id!r} cannot name an audit prefix: {problem}")
        self.storage = storage
        self.instance_id = instance_id

    def load(self) -> dict[str, int]:
        where = f"{self.storage.base_uri}/{self.instance_id}/"
        started = time.monotonic()
        logger.info("loading applied side effects from %s", where)
        keys = self.storage.list(self.instance_id + "/")
        if len(keys) >= LOAD_PROGRESS_EVERY:
            logger.info("%s: listed %d side-effect objects", where, len(keys))
        revisions = highest_revisions(keys, self.instance_id, where)
        logger.info(
            "loaded %d applied side effects of %d rollouts from %s in %.2fs",
            len(keys),
            len(revisions),
            where,
            time.monotonic() - started,
        )
        return revisions

    def key(self, entry: dict[str, Any]) -> str:
        return effect_key(self.instance_id, str(entry["rollout_id"]), int(entry["revision"]))

    def where(self, entry: dict[str, Any]) -> str:
        try:
            return self.storage.uri_for(self.key(entry))
        except StorageError:  # an invalid key: name it as it would be
            return join_key(self.storage.base_uri, self.key(entry))

    def write(self, entry: dict[str, Any]) -> None:
        data = json.dumps(entry, sort_keys=True).encode("utf-8")
        self.storage.write_bytes_if_absent(self.key(entry), data)

    def close(self) -> None:
        pass


def open_effect_store(
    instance_id: str,
    *,
    audit_file: Path | None = None,
    audit_uri: str | None = None,
    client: Any = None,
) -> EffectStore | None:
    """The store ``rolloutrun gym`` flags ask for: a file, a storage URI, or none.

    ``client`` is an optional ``google.cloud.storage.Client`` for a gs:// URI (tests).
    """
    if audit_file is not None and audit_uri is not None:
        raise ValueError("give --audit-file or --audit-uri, not both")
    if audit_file is not None:
        return AuditFileStore(audit_file)
    if audit_uri is not None:
        from rolloutrun_runtime.storage import open_storage

        return StorageEffectStore(open_storage(audit_uri, client=client), instance_id)
    return None


# --------------------------------------------------------------------------- the log
class SideEffectLog:
    """Applied side effects by ``(rollout_id, revision)``, kept in an :class:`EffectStore`.

    Each record is ``{"t", "instance_id", "rollout_id", "attempt", "turn", "revision",
    "effect"}``. Without a store (tests, in-process loops) the log refuses replays only
    within its own lifetime. ``path`` is shorthand for an :class:`AuditFileStore`.
    """

    def __init__(
        self, instance_id: str, path: Path | None = None, *, store: EffectStore | None = None
    ) -> None:
        if path is not None and store is not None:
            raise ValueError("SideEffectLog takes a path or a store, not both")
        self.instance_id = instance_id
        self.store: EffectStore | None = AuditFileStore(path) if path is not None else store
        self._revisions: dict[str, int] = self.store.load() if self.store is not None else {}
        self._writers: ThreadPoolExecutor | None = None

    def applied_revision(self, rollout_id: str) -> int:
        """The highest revision of ``rollout_id`` claimed here (applied, or possibly so)."""
        return self._revisions.get(rollout_id, 0)

    def claim(self, episode: Episode, effect: dict[str, Any]) -> dict[str, Any]:
        """Claim the episode's next revision for ``effect``; refuse one already claimed.

        Synchronous on purpose: the check and the claim cannot interleave with another
        episode of the same rollout.
        """
        rollout_id = episode.episode_id.rollout_id
        revision = episode.revision + 1
        applied = self.applied_revision(rollout_id)
        if revision <= applied:
            raise SideEffectReplayError(
                f"side effect {rollout_id!r} revision {revision} was already applied "
                f"(applied up to {applied}); refusing to repeat it"
            )
        self._revisions[rollout_id] = revision
        return {
            "t": time.time(),
            "instance_id": self.instance_id,
            "rollout_id": rollout_id,
            "attempt": episode.episode_id.attempt,
            "turn": episode.turn,
            "revision": revision,
            "effect": effect,
        }

    def persist(self, entry: dict[str, Any]) -> None:
        """Write ``entry`` to the store (blocking); the errors say which record failed."""
        if self.store is None:
            return
        what = f"side effect {entry['rollout_id']!r} revision {entry['revision']}"
        try:
            self.store.write(entry)
        except ObjectExistsError as error:
            raise SideEffectReplayError(
                f"{what} was already applied (recorded at {error.uri}); refusing to repeat it"
            ) from error
        except (StorageError, ValueError) as error:
            raise SideEffectStorageError(
                f"cannot record {what} at {self.store.where(entry)}: "
                f"{getattr(error, 'reason', error)}; the effect was not applied"
            ) from error

    async def record(self, episode: Episode, effect: dict[str, Any]) -> dict[str, Any]:
        """Claim the next revision and write its record (write-ahead); return the record.

        The caller applies the effect only after this returns. A store that may block is
        written from a worker thread so other episodes keep running; if this coroutine is
        cancelled meanwhile, the revision stays claimed (see the module doc).
        """
        entry = self.claim(episode, effect)
        if self.store is not None and self.store.blocking:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(WRITE_THREADS, "side-effects")
            await asyncio.get_running_loop().run_in_executor(self._writers, self.persist, entry)
        else:
            self.persist(entry)
        return entry

    def close(self) -> None:
        """Wait for writes still in flight (their ``/run`` was cancelled), then close."""
        if self._writers is not None:
            self._writers.shutdown(wait=True)
            self._writers = None
        if self.store is not None:
            self.store.close()

"""Where a Gym replica keeps the side effects it applied: an audit file or storage objects.

Why it matters: every side effect is keyed ``(rollout_id, revision)`` and must never be
applied twice in a run, whichever replica an episode lands on after a restart. So the key is
*run-wide*, not per replica: before applying revision N of a rollout, a replica consults
every effect the run has applied, on any replica, also those applied by pods that were
replaced since. That only holds if the record outlives the pod and is shared by all
replicas. Two stores, one refusal logic (:class:`SideEffectLog`):

* :class:`AuditFileStore` (``rolloutrun gym --audit-file DIR/gym-N.audit.jsonl``): one JSON
  line per effect in the replica's own file, fsynced before the effect is applied. The
  run's effects are every ``*.audit.jsonl`` file of that directory (the replicas of a run
  share it: a local run's log dir, or ``<file:// storage>/gym-audit/``). Each append takes
  the directory's run lock (``flock`` on :data:`AUDIT_RUN_LOCK_NAME`), reads what the other
  replicas appended since (by offset, complete lines only), refuses a revision the run
  already holds, then appends and fsyncs: a check-and-append that no replica can interleave.
  Single writer: the replica holds ``flock`` on ``<file>.lock`` (which names its holder)
  for its whole life, so a force-deleted Gym still running on a lost node and its
  replacement cannot both append; the second one exits naming the first. A torn tail (a
  crash mid-append: its write never returned, so its effect was never applied) is cut back
  to the last complete line when the writer opens the file, and logged; a torn line
  anywhere else fails ``rolloutrun audit``.
* :class:`StorageEffectStore` (``--audit-uri URI``, any URI ``open_storage`` opens, also
  ``gs://``): one create-only object per effect at ``<rollout_id>/<revision, 9
  digits>.json`` under the run's audit prefix (the same for every replica), holding the same
  JSON as an audit-file line. The object is written *before* the effect is applied
  (write-ahead), and a create conflict means the revision was already claimed by some
  replica: the storage itself enforces "never twice", across replicas, pod replacements and
  racing writers. At startup the prefix is listed once; the names alone give the highest
  revision per rollout. Objects of the older per-replica layout
  (``<instance_id>/<rollout_id>/<revision>.json``) are read too, from every replica.

What "twice" means across attempts: a rollout id names one ledger attempt (the trainer mints
``<sibling>_a<uuid>``), and its revisions count its effects. A turn-level restore continues
the *same* rollout under ``attempt + 1`` from its snapshot record, so it continues the same
revision space: revision N+1 follows N whichever replica holds the episode, and a record
whose rollout already applied past it is refused (:func:`choose_restore_source`). Every
other relaunch (a failure, an abandoned or refused episode, an attempt that was only
reserved at the restored cut) gets a fresh rollout id from the trainer, a fresh revision
space: its effects are new effects of a new episode, and the old episode's effects stay
applied exactly once. An episode that would re-apply a revision of its own rollout (the same
rollout relaunched from turn 0) is refused with ``SideEffectReplayError`` (``/run`` answers
409 naming the rollout, revision and where it was recorded); the trainer fails that attempt
and retries the sibling under a new rollout id, so nothing is lost and nothing applied twice.

A revision is claimed in memory before its record is written and stays claimed if the write
fails: its fate is unknown, so it counts as applied. The effect itself is applied only after
the write returned, which makes this at-most-once: a claimed but unapplied revision is never
applied later (the checkpoint control plane refuses to continue an episode whose rollout
applied past it). A ``/run`` cancelled while the write is in flight (its trainer went away)
waits for the write and applies the effect before it stops (``AgentLoop._tool_round``), so
the episode it leaves matches its log and a restore can continue it.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rolloutrun_runtime.contract.layout import (
    AUDIT_FILE_SUFFIX,
    AUDIT_RUN_LOCK_NAME,
    AUDIT_WRITER_LOCK_SUFFIX,
)
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
#: Threads that write effect records: one write per episode at a time, each a round trip
#: or an fsync, so more threads than cores (the event loop's default pool has cores + 4).
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


class AuditFileBusyError(StorageError):
    """Another writer holds the audit file (a second replica with the same file)."""


class EffectStore(Protocol):
    """Durable record of applied side effects, one entry per ``(rollout_id, revision)``."""

    #: Whether :meth:`write` may block on I/O long enough to stall the event loop.
    blocking: bool

    def load(self) -> dict[str, int]:
        """The highest revision per rollout the whole run has recorded, as of now."""
        ...

    def where(self, entry: dict[str, Any]) -> str:
        """The file or object that holds ``entry`` (for messages)."""
        ...

    def write(self, entry: dict[str, Any]) -> None:
        """Record ``entry`` durably; ``ObjectExistsError`` if the run already recorded its
        revision (or a later one, where the store can tell)."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- audit file
def parse_effect_line(line: bytes) -> tuple[str, int] | None:
    """``(rollout_id, revision)`` of one audit-file line, or ``None`` if it is unreadable."""
    try:
        entry = json.loads(line)
        return str(entry["rollout_id"]), int(entry["revision"])
    except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        return None


def complete_lines(data: bytes) -> tuple[list[bytes], int]:
    """The complete (newline-ended) lines of ``data`` and the bytes they span; a torn tail
    (no newline yet: its writer crashed, or is still writing) is left out."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], end


def repair_torn_tail(path: Path) -> int:
    """Cut ``path`` back to its last complete line; return how many bytes were dropped.

    Only the file's single writer may call this (it holds the writer lock). A torn tail is
    an append whose write never returned, so its effect was never applied: dropping it loses
    nothing, while keeping it would glue the next record onto it (both then unreadable).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    _, end = complete_lines(data)
    dropped = len(data) - end
    if dropped:
        with path.open("r+b") as file:
            file.truncate(end)
            os.fsync(file.fileno())
        logger.warning(
            "audit file %s: cut a torn tail of %d bytes after line %d (an append that never "
            "completed; its effect was not applied): %r",
            path,
            dropped,
            data[:end].count(b"\n"),
            data[end:][:200],
        )
    return dropped


def hold_writer_lock(path: Path, wait_s: float = 0.0) -> int:
    """Take ``<path>.lock`` for the life of the writer (an open fd holding ``flock``).

    Waits up to ``wait_s`` for a holder to let go (a replaced pod still exiting); then
    :class:`AuditFileBusyError` naming the holder. The kernel drops the lock when the
    holder dies, so a crash never leaves a stale lock behind.
    """
    lock_path = path.with_name(path.name + AUDIT_WRITER_LOCK_SUFFIX)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    warned = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()
            if time.monotonic() >= deadline:
                os.close(fd)
                raise AuditFileBusyError(
                    str(path),
                    f"another writer holds {lock_path.name} ({holder or 'holder unknown'}); "
                    "two Gym replicas may not append to one audit file",
                ) from None
            if not warned:
                logger.warning("audit file %s: waiting for its writer %s to exit", path, holder)
                warned = True
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)
    return fd


class AuditFileStore:
    """Effects as JSON lines in this replica's file, checked against every replica's file of
    the directory under the run lock (see the module doc)."""

    blocking = True  # an fsync per effect

    def __init__(self, path: Path, *, lock_wait_s: float = 0.0) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._mutex = threading.Lock()  # this process's threads; flock orders the processes
        self._offsets: dict[Path, int] = {}  # bytes read (complete lines) per run file
        self._line_numbers: dict[Path, int] = {}
        self._revisions: dict[str, int] = {}
        self._recorded_in: dict[str, Path] = {}  # the file holding each rollout's highest
        self._fd: int | None = None
        self._run_lock_fd: int | None = None
        self._writer_fd: int | None = hold_writer_lock(path, lock_wait_s)
        try:
            self._run_lock_fd = os.open(
                path.parent / AUDIT_RUN_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644
            )
            with self._run_lock():
                repair_torn_tail(path)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._catch_up()
        except BaseException:
            self.close()
            raise

    @contextmanager
    def _run_lock(self) -> Iterator[None]:
        assert self._run_lock_fd is not None
        fcntl.flock(self._run_lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._run_lock_fd, fcntl.LOCK_UN)

    def run_files(self) -> list[Path]:
        """This replica's file and every other replica's of the same directory."""
        return sorted({self.path, *self.path.parent.glob("*" + AUDIT_FILE_SUFFIX)})

    def _catch_up(self) -> None:
        """Read the complete lines appended to any run file since the last call."""
        for file in self.run_files():
            offset = self._offsets.get(file, 0)
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                continue
            if size < offset:  # cut back below what we read: not by a repair; read it again
                logger.warning("audit file %s shrank to %d bytes; reading it again", file, size)
                offset, self._line_numbers[file] = 0, 0
            if size == offset:
                continue
            with file.open("rb") as handle:
                handle.seek(offset)
                lines, used = complete_lines(handle.read(size - offset))
            number = self._line_numbers.get(file, 0)
            for line in lines:
                number += 1
                if not line.strip():
                    continue
                parsed = parse_effect_line(line)
                if parsed is None:
                    logger.warning("audit file %s: skipping unreadable line %d", file, number)
                    continue
                self._note(*parsed, file)
            self._offsets[file], self._line_numbers[file] = offset + used, number

    def _note(self, rollout_id: str, revision: int, file: Path) -> None:
        if revision > self._revisions.get(rollout_id, 0):
            self._revisions[rollout_id] = revision
            self._recorded_in[rollout_id] = file

    def load(self) -> dict[str, int]:
        with self._mutex:
            if self._fd is None:
                raise StorageError(str(self.path), "the audit file is closed")
            with self._run_lock():
                self._catch_up()
            return dict(self._revisions)

    def where(self, entry: dict[str, Any]) -> str:
        return str(self.path)

    def write(self, entry: dict[str, Any]) -> None:
        rollout_id, revision = str(entry["rollout_id"]), int(entry["revision"])
        data = (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8")
        with self._mutex:
            if self._fd is None:
                raise StorageError(str(self.path), "the audit file is closed")
            try:
                with self._run_lock():
                    self._catch_up()
                    applied = self._revisions.get(rollout_id, 0)
                    if revision <= applied:
                        raise ObjectExistsError(
                            str(self._recorded_in[rollout_id]),
                            f"rollout {rollout_id!r} was applied up to revision {applied}",
                        )
                    self._append(data)
                    self._note(rollout_id, revision, self.path)
            except OSError as error:
                raise StorageError(str(self.path), f"cannot append: {error}") from error

    def _append(self, data: bytes) -> None:
        """Append ``data`` whole and fsync it; on a failed write, cut the partial line."""
        assert self._fd is not None
        start = self._offsets.get(self.path, 0)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            os.ftruncate(self._fd, start)  # never leave a torn line to glue the next onto
            raise
        os.fsync(self._fd)
        self._offsets[self.path] = start + len(data)
        self._line_numbers[self.path] = self._line_numbers.get(self.path, 0) + 1

    def close(self) -> None:
        with self._mutex:
            for name in ("_fd", "_run_lock_fd", "_writer_fd"):
                fd = getattr(self, name)
                if fd is not None:
                    os.close(fd)  # closing the writer lock's fd releases it
                    setattr(self, name, None)


# --------------------------------------------------------------------------- storage
def rollout_key_part(rollout_id: str) -> str:
    """``rollout_id`` as one key part (a leading '.' escaped); see :func:`parse_effect_key`."""
    return _LEADING_DOT + rollout_id[1:] if rollout_id.startswith(".") else rollout_id


def effect_key(rollout_id: str, revision: int) -> str:
    """``<rollout_id>/<revision, 9 digits>.json``: one key per effect for the whole run."""
    return f"{rollout_key_part(rollout_id)}/{revision:0{REVISION_DIGITS}d}.json"


def legacy_effect_key(instance_id: str, rollout_id: str, revision: int) -> str:
    """``<instance_id>/<rollout_id>/<revision>.json``: the per-replica layout of older
    versions (still read, never written)."""
    return f"{instance_id}/{effect_key(rollout_id, revision)}"


def parse_effect_key(key: str) -> tuple[str | None, str, int] | None:
    """``(instance_id, rollout_id, revision)`` of an effect object's key, or ``None``.

    ``instance_id`` is ``None`` for the run-wide layout (:func:`effect_key`) and names the
    replica for the older per-replica one (:func:`legacy_effect_key`).
    """
    parts = key.split("/")
    if len(parts) not in (2, 3) or not parts[-1].endswith(".json"):
        return None
    instance_id = parts[0] if len(parts) == 3 else None
    part, name = parts[-2:]
    digits = name[: -len(".json")]
    if not digits.isdigit() or not part or instance_id == "":
        return None
    rollout_id = "." + part[len(_LEADING_DOT) :] if part.startswith(_LEADING_DOT) else part
    return instance_id, rollout_id, int(digits)


def highest_revisions(keys: list[str], where: str) -> dict[str, int]:
    """The highest revision per rollout among the run's effect ``keys`` (both layouts, every
    replica).

    Only names are used, not contents: an object whose name exists claims its revision even
    if its body is unreadable. Keys that are not effect objects are logged and skipped.
    """
    revisions: dict[str, int] = {}
    skipped = 0
    for count, key in enumerate(keys, 1):
        parsed = parse_effect_key(key)
        if parsed is None:
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
    """Why ``instance_id`` cannot name a replica in a record or older key, or ``None``."""
    if "/" in instance_id:
        return "it contains '/'"
    return key_problem(instance_id)


class StorageEffectStore:
    """Effects as create-only objects ``<rollout_id>/<revision>.json`` under the run's audit
    prefix, shared by every replica (see the module doc)."""

    blocking = True  # a network round trip on gs://, fsyncs on file://

    def __init__(self, storage: CheckpointStorage, instance_id: str) -> None:
        problem = instance_id_problem(instance_id)
        if problem is not None:
            raise ValueError(f"instance id {instance_id!r} cannot name an audit prefix: {problem}")
        self.storage = storage
        self.instance_id = instance_id

    def load(self) -> dict[str, int]:
        where = f"{self.storage.base_uri}/"
        started = time.monotonic()
        logger.info("loading the run's applied side effects from %s", where)
        keys = self.storage.list()
        if len(keys) >= LOAD_PROGRESS_EVERY:
            logger.info("%s: listed %d side-effect objects", where, len(keys))
        revisions = highest_revisions(keys, where)
        logger.info(
            "loaded %d applied side effects of %d rollouts from %s in %.2fs",
            len(keys),
            len(revisions),
            where,
            time.monotonic() - started,
        )
        return revisions

    def key(self, entry: dict[str, Any]) -> str:
        return effect_key(str(entry["rollout_id"]), int(entry["revision"]))

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
    lock_wait_s: float = 0.0,
) -> EffectStore | None:
    """The store ``rolloutrun gym`` flags ask for: a file, a storage URI, or none.

    ``client`` is an optional ``google.cloud.storage.Client`` for a gs:// URI (tests);
    ``lock_wait_s`` how long an audit file's writer waits for a previous holder to exit.
    """
    if audit_file is not None and audit_uri is not None:
        raise ValueError("give --audit-file or --audit-uri, not both")
    if audit_file is not None:
        return AuditFileStore(audit_file, lock_wait_s=lock_wait_s)
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
        """The highest revision of ``rollout_id`` claimed (applied, or possibly so) by this
        replica, or by any replica of the run as of the last :meth:`refresh` (or startup)."""
        return self._revisions.get(rollout_id, 0)

    def refresh(self) -> None:
        """Merge in what every replica of the run has recorded since (blocking: a listing
        or a read of the other audit files); a restore calls it before deciding."""
        if self.store is None:
            return
        for rollout_id, revision in self.store.load().items():
            if revision > self._revisions.get(rollout_id, 0):
                self._revisions[rollout_id] = revision

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
                f"{what} was already applied in this run (recorded at {error.uri}: "
                f"{error.reason}); refusing to repeat it"
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
        cancelled meanwhile, the revision stays claimed (the agent loop shields it, so its
        ``/run`` being cancelled does not cancel it).
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

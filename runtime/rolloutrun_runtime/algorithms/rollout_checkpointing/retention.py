"""What follows a snapshot's commit: the LATEST hint and retention, planned (pure).

Why its own module: these are the publisher's decisions after its commit point (which
snapshots retention deletes, what LATEST says), kept apart from the I/O of
:mod:`.manifest` so each is read and tested on its own. On file:// with a writer process
they travel with the commit's own call (``storage.AfterCommit``) and run only once the
commit is durable.
"""

from __future__ import annotations

import json
import logging
import time

from rolloutrun_runtime.contract.layout import LATEST_KEY, MANIFEST_NAME, snapshot_dir
from rolloutrun_runtime.storage import AfterCommit, join_key

log = logging.getLogger(__name__)


def retention_plan(
    snapshot_ids: list[int], committed: list[int], newest_valid: int | None, keep_latest: int
) -> tuple[list[int], list[int]]:
    """Which committed snapshots retention deletes (beyond the newest ``keep_latest``, never
    ``newest_valid``), and which uncommitted folders may be leftovers (those numbered below
    the newest committed one; deleted only once old enough)."""
    keep = set(committed[-keep_latest:]) | ({newest_valid} if newest_valid is not None else set())
    doomed = [sid for sid in committed if sid not in keep]
    newest = committed[-1] if committed else None
    known = set(committed)
    leftovers = [s for s in snapshot_ids if s not in known and newest is not None and s < newest]
    return doomed, leftovers


def latest_pointer(entry: str, manifest_uri: str) -> bytes:
    """LATEST's bytes: a hint for people and tools; readers verify and never trust it alone,
    so it is written without the fsyncs of a durable write (a power loss may leave an older
    one; the manifests are the truth)."""
    pointer = {"entry": entry, "manifest_uri": manifest_uri, "written_at": time.time()}
    return json.dumps(pointer, sort_keys=True).encode()


def after_commit_of(
    entry: str, manifest_uri: str, snapshot_id: int, keep_latest: int | None, committed: list[int]
) -> AfterCommit:
    """LATEST and retention's deletes of committed snapshots, to go with the commit (on
    file://, in its one call of the writer process) and run only once it is durable."""
    after = AfterCommit(hints={LATEST_KEY: latest_pointer(entry, manifest_uri)})
    if keep_latest is not None:
        doomed, _ = retention_plan(committed, committed, snapshot_id, keep_latest)
        after.delete_markers = [join_key(snapshot_dir(s), MANIFEST_NAME) for s in doomed]
    return after


def log_after_commit_failures(after: AfterCommit, snapshot_id: int) -> None:
    """A hint or delete that failed after the commit: logged, never raised (it stands)."""
    for key, why in sorted(after.failed.items()):
        log.warning("after publishing snapshot %d, %s failed: %s", snapshot_id, key, why)

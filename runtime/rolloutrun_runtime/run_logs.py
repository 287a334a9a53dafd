"""What users watch, kept in the run's storage: ``metrics.jsonl``, the rollout trace and the
RunConfig of every trainer process, past the pod that wrote them.

Why segments of create-once parts: on a cluster the log directory is an emptyDir that dies
with each pod, and an object store cannot append. So each trainer process ships the complete
lines its local log files gain into parts ``run_logs/<log>/<segment>/part-<n>.jsonl`` of its
own segment (``i<incarnation>-<start ms>-<run id>``, names in
:mod:`rolloutrun_runtime.contract.layout`); a published part is never rewritten, and a
reader concatenates segments in name order (incarnation, then start time) and each
segment's parts in number order. A shipper
runs in a thread every :data:`SHIP_INTERVAL_S` and once more when the trainer stops, so a
pod killed without a stop loses at most the last interval's lines in storage.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.layout import (
    CONFIG_LOG,
    LOG_PART,
    LOG_SEGMENT,
    config_key,
    log_part_key,
    log_prefix,
)

logger = logging.getLogger(__name__)

#: Seconds between two shipments of a log's new lines to the run's storage.
SHIP_INTERVAL_S = 10.0


class LogShipper:
    """Ships the complete lines a local file gains (from its size at start) into parts."""

    def __init__(
        self, storage: Any, log: str, path: Path, segment: str, interval_s: float = SHIP_INTERVAL_S
    ) -> None:
        self.storage = storage
        self.log = log
        self.path = path
        self.segment = segment
        self.interval_s = interval_s
        self.offset = path.stat().st_size if path.exists() else 0
        self.parts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ship-{log}", daemon=True)

    def start(self) -> LogShipper:
        self._thread.start()
        return self

    def ship(self) -> int:
        """Publish the complete lines written since the last shipment as one part; bytes."""
        with self._lock:
            if not self.path.exists():
                return 0
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next one
            if end == 0:
                return 0
            self.storage.write_bytes(
                log_part_key(self.log, self.segment, self.parts + 1), data[:end]
            )
            self.parts += 1
            self.offset += end
            return end

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._ship_logged()

    def _ship_logged(self) -> None:
        try:
            self.ship()
        except Exception as error:  # storage down: keep the lines, try again next time
            logger.warning("could not ship %s to the run's storage: %s", self.log, error)

    def close(self) -> None:
        """Stop the thread and ship what is left."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._ship_logged()


@dataclass(frozen=True)
class _Part:
    segment: str
    number: int
    key: str


def _parts(storage: Any, log: str) -> list[_Part]:
    prefix = log_prefix(log)
    parts = []
    for key in storage.list(prefix):
        segment, _, name = key[len(prefix) :].partition("/")
        part = LOG_PART.match(name)
        if LOG_SEGMENT.match(segment) and part:
            parts.append(_Part(segment, int(part.group(1)), key))
    return sorted(parts, key=lambda p: (p.segment, p.number))


def read_log_lines(storage: Any, log: str, *, threads: int = 16) -> list[str]:
    """Every line of log ``log`` in the run's storage, in order (empty when none); the parts
    are read in parallel (one request each on an object store)."""
    from concurrent.futures import ThreadPoolExecutor

    keys = [part.key for part in _parts(storage, log)]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(keys) or 1))) as pool:
        blobs = list(pool.map(storage.read_bytes, keys))
    lines = [line for blob in blobs for line in blob.decode("utf-8", "replace").splitlines()]
    return [line for line in lines if line.strip()]


def read_stored_metrics(storage: Any) -> list[dict[str, Any]]:
    """Every step record in the run's storage (every incarnation's), in order."""
    from rolloutrun_runtime.contract.layout import METRICS_LOG

    return [json.loads(line) for line in read_log_lines(storage, METRICS_LOG)]


def write_config(storage: Any, segment: str, config: dict[str, Any]) -> None:
    """Keep the RunConfig a trainer process runs, next to its logs."""
    storage.write_bytes(config_key(segment), json.dumps(config, sort_keys=True).encode())


def read_latest_config(storage: Any) -> dict[str, Any] | None:
    """The RunConfig of the newest trainer process that kept one (None when none did)."""
    prefix = log_prefix(CONFIG_LOG)
    names = sorted(
        key
        for key in storage.list(prefix)
        if key.endswith(".json") and LOG_SEGMENT.match(key[len(prefix) : -len(".json")])
    )
    if not names:
        return None
    document = json.loads(storage.read_bytes(names[-1]))
    return document if isinstance(document, dict) else None

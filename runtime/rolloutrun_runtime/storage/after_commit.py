"""What a publisher does right after its commit point, in the commit's own request.

Why: after a snapshot's manifest is linked, the publisher writes the LATEST hint and
retention deletes the snapshots beyond ``keepLatest``. On file:// with a writer process
(:mod:`.writer_process`) each of those was a round trip of its own: a request the trainer
encodes and the child decodes, a wake-up of each, a reply; three per snapshot where one
suffices. An :class:`AfterCommit` travels with the commit's ``settle`` call instead, and the
child runs it after the settle, in the order the separate calls had: the new name durable
first, then the hints (not durable: readers never trust them alone), then each entry's
marker deleted (durably) before its files.

Nothing of it is done unless the commit is: the settle runs first, and a settle that fails
answers with its error before any hint or delete. A hint or delete that fails is recorded,
never raised: the commit stands, as it did when those were separate calls whose errors were
logged (a delete left behind is retried by the next retention pass).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .errors import StorageError


@dataclasses.dataclass
class AfterCommit:
    """Hints to write (key -> bytes, not durable), then entries to delete (by marker key);
    :meth:`run` fills ``deleted`` (marker -> files deleted besides it) and ``failed``
    (key or marker -> why)."""

    hints: dict[str, bytes] = dataclasses.field(default_factory=dict)
    delete_markers: list[str] = dataclasses.field(default_factory=list)
    deleted: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)

    def run(
        self,
        write_hint: Callable[[str, bytes], None],
        delete_marked: Callable[[str], int],
    ) -> None:
        """The hints, then the deletes, in order; each failure recorded, the rest done."""
        for key, data in self.hints.items():
            try:
                write_hint(key, data)
            except StorageError as error:
                self.failed[key] = str(error)
        for marker in self.delete_markers:
            try:
                self.deleted[marker] = delete_marked(marker)
            except StorageError as error:
                self.failed[marker] = str(error)

    # ------------------------------------------------------------------ the wire (pure)
    def wire(self) -> tuple[dict[str, Any], list[bytes]]:
        """The request's arguments and blobs (the hints' bytes, in the keys' order)."""
        keys = list(self.hints)
        return {"hints": keys, "delete_markers": list(self.delete_markers)}, [
            bytes(self.hints[k]) for k in keys
        ]

    @classmethod
    def from_wire(cls, args: Mapping[str, Any], blobs: list[bytes]) -> AfterCommit:
        keys = [str(k) for k in args["hints"]]
        return cls(
            hints=dict(zip(keys, blobs, strict=True)),
            delete_markers=[str(m) for m in args["delete_markers"]],
        )

    def outcome(self) -> dict[str, Any]:
        """What :meth:`run` found, as the child answers it."""
        return {"deleted": dict(self.deleted), "failed": dict(self.failed)}

    def take(self, outcome: Mapping[str, Any]) -> None:
        """The child's :meth:`outcome`, recorded here (the trainer's copy)."""
        self.deleted.update({str(k): int(v) for k, v in outcome["deleted"].items()})
        self.failed.update({str(k): str(v) for k, v in outcome["failed"].items()})

"""The trainer checkpoint's errors: unreadable, tampered with, or another trajectory's.

Why a module of their own: the marker, the file codecs and the store all raise them, and
callers (the controller, restore) tell them apart: an integrity error names a file changed
after its commit, a clash names two writers of one step with different weights.
"""

from __future__ import annotations


class TrainerCheckpointError(RuntimeError):
    """A trainer checkpoint cannot be written or read."""


class CheckpointIntegrityError(TrainerCheckpointError):
    """A file of a committed checkpoint is missing or differs from the marker's sha256."""


class CheckpointClashError(TrainerCheckpointError):
    """``step_<N>`` is committed by another writer with other weights (another trajectory).

    The caller must not anchor to that entry; see ``SingleController._publish``.
    """

    def __init__(self, uri: str, theirs: str, ours: str, differing: list[str]) -> None:
        self.uri, self.theirs, self.ours, self.differing = uri, theirs, ours, differing
        super().__init__(
            f"{uri}: already committed by {theirs}, differing in {', '.join(differing)} from "
            f"what this writer, {ours}, holds; those weights belong to another trajectory and "
            "are not this run's anchor"
        )

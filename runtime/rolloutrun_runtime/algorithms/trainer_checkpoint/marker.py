"""The ``COMMITTED`` marker of a ``step_<N>`` entry and the writer it names.

Why the marker (format 2) names its writer (incarnation, Lease holder, process) and the sha256
of every file: a step can be published twice, by two incarnations, and the create-only
marker only says who was first. An incarnation that finds ``step_<N>`` already committed
takes it as its own only when the weights trajectory is the same: the same sha256 for the
model and optimizer files (``TRAJECTORY_FILES``; the deterministic retrain of a step an
earlier incarnation committed). Otherwise the store raises :class:`CheckpointClashError`,
naming both writers. The other files may differ between writers of one trajectory and are
not compared: ``trainer_state.json`` holds step timings, and the process-wide RNG states
are drawn by libraries (the storage client's retry jitter draws Python's ``random``) while
training draws only its own seeded generators.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolloutrun_runtime.algorithms.trainer_checkpoint.errors import TrainerCheckpointError
from rolloutrun_runtime.contract.layout import (
    LEGACY_TRAINER_CHECKPOINT_FORMAT,
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_CHECKPOINT_FORMAT,
)
from rolloutrun_runtime.contract.pod import (
    ENV_INCARNATION,
    ENV_LEASE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    holder_identity,
)

#: The files that fix the weights trajectory a snapshot anchored to the step continues from.
TRAJECTORY_FILES = (MODEL_FILE, OPTIMIZER_FILE)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


# --------------------------------------------------------------------------- the writer
@dataclass(frozen=True)
class CheckpointWriter:
    """Who publishes: the incarnation, its Lease holder identity, the process."""

    incarnation: int
    holder: str | None
    process: str

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> CheckpointWriter:
        """The trainer's identity as its pod describes it (the one its Lease holds)."""
        env = os.environ if environ is None else environ
        incarnation = int(env.get(ENV_INCARNATION, "0") or 0)
        pod = env.get(ENV_POD_NAME)
        leased = env.get(ENV_LEASE_NAME) and env.get(ENV_POD_NAMESPACE)
        return cls(
            incarnation=incarnation,
            holder=holder_identity(pod, incarnation) if leased and pod else None,
            process=f"{socket.gethostname()}:{os.getpid()}",
        )

    def to_json(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "holder": self.holder, "process": self.process}

    @classmethod
    def from_json(cls, data: Any) -> CheckpointWriter | None:
        if not isinstance(data, dict):
            return None
        incarnation, holder, process = (data.get(k) for k in ("incarnation", "holder", "process"))
        if not isinstance(incarnation, int) or not isinstance(process, str):
            return None
        return cls(incarnation, holder if isinstance(holder, str) else None, process)

    def describe(self) -> str:
        holder = f"lease holder {self.holder}" if self.holder else "no lease"
        return f"incarnation {self.incarnation} ({holder}, process {self.process})"


def describe_writer(writer: CheckpointWriter | None) -> str:
    return writer.describe() if writer is not None else "an unknown writer (format 1 marker)"


# --------------------------------------------------------------------------- the marker
def file_digest(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@dataclass(frozen=True)
class CommitMarker:
    """The ``COMMITTED`` payload: the step, its writer and every file's sha256."""

    step: int
    format: int
    writer: CheckpointWriter | None
    files: dict[str, dict[str, Any]] | None  # None: format 1, nothing to verify against

    def to_bytes(self) -> bytes:
        data = {
            "format": self.format,
            "step": self.step,
            "writer": self.writer.to_json() if self.writer else None,
            "files": self.files,
        }
        return json.dumps(data, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, source: str) -> CommitMarker:
        """Parse a marker; an empty payload or ``{"step": N}`` is format 1."""
        if not raw.strip():
            return cls(step=-1, format=LEGACY_TRAINER_CHECKPOINT_FORMAT, writer=None, files=None)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TrainerCheckpointError(f"{source}: marker is not valid JSON ({error})") from error
        if not isinstance(data, dict) or not isinstance(data.get("step", -1), int):
            raise TrainerCheckpointError(f"{source}: marker is not a {{step, ...}} JSON object")
        version = data.get("format", LEGACY_TRAINER_CHECKPOINT_FORMAT)
        if version == LEGACY_TRAINER_CHECKPOINT_FORMAT:
            return cls(step=data.get("step", -1), format=version, writer=None, files=None)
        if version != TRAINER_CHECKPOINT_FORMAT:
            raise TrainerCheckpointError(
                f"{source}: trainer checkpoint format {version!r} is not readable (this runtime "
                f"reads {LEGACY_TRAINER_CHECKPOINT_FORMAT} and {TRAINER_CHECKPOINT_FORMAT})"
            )
        files = data.get("files")
        if not isinstance(files, dict) or not all(
            isinstance(name, str)
            and isinstance(digest, dict)
            and isinstance(digest.get("sha256"), str)
            and _SHA256.match(digest["sha256"])
            and isinstance(digest.get("bytes"), int)
            for name, digest in files.items()
        ):
            raise TrainerCheckpointError(f"{source}: marker lists no valid file checksums")
        return cls(
            step=data["step"],
            format=version,
            writer=CheckpointWriter.from_json(data.get("writer")),
            files=files,
        )


def differing_trajectory_files(
    ours: Mapping[str, Mapping[str, Any]], theirs: Mapping[str, Mapping[str, Any]] | None
) -> list[str]:
    """The trajectory files whose sha256 differs between two writers (all when unknown)."""
    if theirs is None:
        return list(TRAJECTORY_FILES)
    return [
        name
        for name in TRAJECTORY_FILES
        if name not in ours
        or name not in theirs
        or ours[name].get("sha256") != theirs[name].get("sha256")
    ]

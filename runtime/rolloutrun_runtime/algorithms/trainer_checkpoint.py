"""Trainer checkpoints ``step_<N>``: captured under the cut, published atomically, retained.

Why two phases: everything that must agree (weights, optimizer, dataloader cursor, sampler,
RNG, the rollout state and the data plane) is *captured* while the controller holds the
exclusive data-plane cut, as cheap in-memory copies; serializing and writing happen after the
cut is released, so the pumps stall only for the copy. Publication goes through
``publish_entry``: every file first, the create-only ``COMMITTED`` marker last, so a reader
(resume, or a snapshot checking that its anchor is durable) trusts only complete entries.

Retention keeps the ``keep_latest`` newest committed steps and never the newest one away; a
failed delete is logged and retried at the next publication.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rolloutrun_runtime.storage import (
    DEFAULT_MARKER,
    CheckpointStorage,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    delete_entry,
    list_committed,
    publish_entry,
)

logger = logging.getLogger(__name__)

TRAINER_CHECKPOINT_FORMAT = 1
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
_STEP_ENTRY = re.compile(r"^step_(\d+)$")


class TrainerCheckpointError(RuntimeError):
    """A trainer checkpoint cannot be written or read."""


def step_entry(step: int) -> str:
    return f"step_{step}"


def capture_rng() -> dict[str, Any]:
    """The process's RNG states (torch CPU, numpy global, Python)."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


@dataclass
class TrainerCapture:
    """In-memory copies taken under the exclusive cut; serialized after it."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, Any]
    trainer_state: dict[str, Any]
    extra_files: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def take(
        cls,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: Mapping[str, Any],
        extra_files: Mapping[str, bytes] | None = None,
    ) -> TrainerCapture:
        return cls(
            step=step,
            model_state={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
            optimizer_state=copy.deepcopy(optimizer.state_dict()),
            rng_state=capture_rng(),
            trainer_state={"format": TRAINER_CHECKPOINT_FORMAT, "step": step, **trainer_state},
            extra_files=dict(extra_files or {}),
        )

    def to_files(self) -> dict[str, bytes]:
        files = dict(self.extra_files)
        files[MODEL_FILE] = _torch_bytes(self.model_state)
        files[OPTIMIZER_FILE] = _torch_bytes(self.optimizer_state)
        files[RNG_FILE] = _torch_bytes(self.rng_state)
        files[STATE_FILE] = json.dumps(self.trainer_state, sort_keys=True, indent=1).encode()
        return files


@dataclass
class LoadedTrainerCheckpoint:
    """A committed ``step_<N>`` read back."""

    step: int
    uri: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, Any]
    trainer_state: dict[str, Any]
    files: dict[str, bytes]


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _torch_load(data: bytes, what: str) -> Any:
    try:
        # RNG states hold numpy arrays and tuples: only our own files are loaded here.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as error:
        raise TrainerCheckpointError(f"cannot read {what}: {error}") from error


class TrainerCheckpointer:
    """Publishes, lists, loads and prunes ``step_<N>`` entries in one storage."""

    def __init__(self, storage: CheckpointStorage, keep_latest: int) -> None:
        if keep_latest < 1:
            raise TrainerCheckpointError("keep_latest must be >= 1")
        self.storage = storage
        self.keep_latest = keep_latest

    def committed_steps(self) -> list[int]:
        steps = []
        for entry in list_committed(self.storage, ""):
            match = _STEP_ENTRY.match(entry.rsplit("/", 1)[-1])
            if match and "/" not in entry:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def is_durable(self, step: int) -> bool:
        return step in self.committed_steps()

    def publish(self, capture: TrainerCapture) -> str:
        """Serialize and publish ``capture`` (blocking; run it off the event loop)."""
        return self.publish_files(capture.step, capture.to_files())

    def publish_files(self, step: int, files: Mapping[str, bytes]) -> str:
        """Publish serialized files as ``step_<step>`` (marker last), then apply retention.

        A step that is already committed stays as it is: an earlier incarnation made it
        durable, and this one retrained through it after resuming from a snapshot anchored
        before it (the same journaled groups, in the same order). Its entry is kept and the
        step counts as durable; writing it again would fail the create-only commit and send
        every later incarnation into the same crash.
        """
        entry = step_entry(step)
        try:
            uri = publish_entry(
                self.storage,
                entry,
                files,
                marker_payload=json.dumps({"step": step}).encode(),
            )
        except ObjectExistsError:
            uri = self.storage.uri_for(f"{entry}/{DEFAULT_MARKER}")
            logger.warning(
                "trainer checkpoint %s was already committed by an earlier incarnation; "
                "keeping it (this run retrained through step %d after resuming)",
                uri,
                step,
            )
            return uri
        logger.info("published trainer checkpoint %s", uri)
        self.apply_retention()
        return uri

    def apply_retention(self) -> list[int]:
        """Delete committed steps beyond the newest ``keep_latest``; returns those deleted."""
        steps = self.committed_steps()
        doomed = steps[: max(0, len(steps) - self.keep_latest)]
        deleted = []
        for step in doomed:
            try:
                delete_entry(self.storage, step_entry(step))
                deleted.append(step)
            except StorageError as error:
                logger.warning("could not delete trainer checkpoint step_%d: %s", step, error)
        return deleted

    def load(self, step: int, extra_names: tuple[str, ...] = ()) -> LoadedTrainerCheckpoint:
        entry = step_entry(step)
        if not self.is_durable(step):
            raise TrainerCheckpointError(f"{self.storage.uri_for(entry)} is not committed")
        files: dict[str, bytes] = {}
        for name in (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE):
            required = self._read(entry, name, required=True)
            assert required is not None
            files[name] = required
        for name in extra_names:
            data = self._read(entry, name, required=False)
            if data is not None:
                files[name] = data
        state = json.loads(files[STATE_FILE])
        if state.get("format") != TRAINER_CHECKPOINT_FORMAT:
            raise TrainerCheckpointError(
                f"{self.storage.uri_for(entry)}: trainer checkpoint format "
                f"{state.get('format')!r} is not readable (this runtime reads "
                f"{TRAINER_CHECKPOINT_FORMAT})"
            )
        return LoadedTrainerCheckpoint(
            step=step,
            uri=self.storage.uri_for(entry),
            model_state=_torch_load(files[MODEL_FILE], f"{entry}/{MODEL_FILE}"),
            optimizer_state=_torch_load(files[OPTIMIZER_FILE], f"{entry}/{OPTIMIZER_FILE}"),
            rng_state=_torch_load(files[RNG_FILE], f"{entry}/{RNG_FILE}"),
            trainer_state=state,
            files=files,
        )

    def _read(self, entry: str, name: str, *, required: bool) -> bytes | None:
        try:
            return self.storage.read_bytes(f"{entry}/{name}")
        except ObjectNotFoundError as error:
            if required:
                raise TrainerCheckpointError(
                    f"{self.storage.uri_for(entry)} lacks {name}"
                ) from error
            return None

"""Trainer checkpoints ``step_<N>``: captured under the cut, published atomically, retained.

Why two phases: everything that must agree (weights, optimizer, dataloader cursor, sampler,
RNG, the rollout state and the data plane) is *captured* while the controller holds the
exclusive data-plane cut, as cheap in-memory copies; serializing and writing happen after the
cut is released, so the pumps stall only for the copy. Publication goes through
``publish_entry``: every file first, the create-only ``COMMITTED`` marker last, so a reader
(resume, or a snapshot checking that its anchor is durable) trusts only complete entries.

The marker (format 2) names its writer (incarnation, Lease holder, process) and the sha256 of
every file. Why: a step can be published twice, by two incarnations, and the create-only
marker only says who was first. An incarnation that finds ``step_<N>`` already committed
takes it as its own only when the weights trajectory is the same: the same sha256 for the
model and optimizer files (``TRAJECTORY_FILES``; the deterministic retrain of a step an
earlier incarnation committed). Otherwise it raises :class:`CheckpointClashError`, naming
both writers, and the controller does not anchor to those foreign weights. The other files
may differ between writers of one trajectory and are not compared: ``trainer_state.json``
holds step timings, and the process-wide RNG states are drawn by libraries (the storage
client's retry jitter draws Python's ``random``) while training draws only its own seeded
generators. A reader of the entry gets the committed writer's files as one unit.

The lease check (``fence``) runs at the commit point, immediately before the marker: a
trainer whose lease a newer incarnation took while it uploaded commits nothing.

Nothing read from storage can run code: model and optimizer load with
``torch.load(weights_only=True)``, the RNG state is JSON, and every file is checked against
the marker's sha256 before it is decoded. Format 1 entries (no checksums, the RNG state
pickled with numpy arrays) are still read, with the same restricted unpickler allowing only
numpy's array reconstruction, and a warning that they cannot be verified.

Retention keeps the ``keep_latest`` newest committed steps and never the newest one away; a
failed delete is logged and retried at the next publication.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib
import io
import json
import logging
import os
import random
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rolloutrun_runtime.coordination import (
    ENV_INCARNATION,
    ENV_LEASE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    holder_identity,
)
from rolloutrun_runtime.storage import (
    DEFAULT_MARKER,
    CheckpointStorage,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    delete_entry,
    join_key,
    list_committed,
    publish_entry,
)

logger = logging.getLogger(__name__)

TRAINER_CHECKPOINT_FORMAT = 2
#: Format 1: a ``{"step": N}`` marker without checksums, the RNG state pickled in ``rng.pt``.
LEGACY_FORMAT = 1
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.json"
LEGACY_RNG_FILE = "rng.pt"
STATE_FILE = "trainer_state.json"
#: The files that fix the weights trajectory a snapshot anchored to the step continues from.
TRAJECTORY_FILES = (MODEL_FILE, OPTIMIZER_FILE)
_STEP_ENTRY = re.compile(r"^step_(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def step_entry(step: int) -> str:
    return f"step_{step}"


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
            return cls(step=-1, format=LEGACY_FORMAT, writer=None, files=None)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TrainerCheckpointError(f"{source}: marker is not valid JSON ({error})") from error
        if not isinstance(data, dict) or not isinstance(data.get("step", -1), int):
            raise TrainerCheckpointError(f"{source}: marker is not a {{step, ...}} JSON object")
        version = data.get("format", LEGACY_FORMAT)
        if version == LEGACY_FORMAT:
            return cls(step=data.get("step", -1), format=version, writer=None, files=None)
        if version != TRAINER_CHECKPOINT_FORMAT:
            raise TrainerCheckpointError(
                f"{source}: trainer checkpoint format {version!r} is not readable (this runtime "
                f"reads {LEGACY_FORMAT} and {TRAINER_CHECKPOINT_FORMAT})"
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


# --------------------------------------------------------------------------- RNG state
def capture_rng() -> dict[str, Any]:
    """The process's RNG states (torch CPU, CUDA when in use, numpy global, Python)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda"):
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("the checkpoint holds CUDA RNG states but CUDA is not available")


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.to("cpu").contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: Any, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise TrainerCheckpointError(f"{what} is not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as error:
        raise TrainerCheckpointError(f"{what} is not valid base64 ({error})") from error
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def encode_rng(state: Mapping[str, Any]) -> bytes:
    """The RNG states as JSON (bit-exact: integers, base64 bytes, floats by repr)."""
    kind, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss_next = state["python"]
    data: dict[str, Any] = {
        "torch": _b64(state["torch"]),
        "numpy": {
            "kind": str(kind),
            "keys": [int(key) for key in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if state.get("cuda"):
        data["cuda"] = [_b64(device_state) for device_state in state["cuda"]]
    return json.dumps(data, sort_keys=True).encode()


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def decode_rng(raw: bytes, source: str) -> dict[str, Any]:
    """The states :func:`restore_rng` takes, from :func:`encode_rng`'s JSON (checked)."""
    try:
        data = json.loads(raw.decode("utf-8"))
        numpy_state, python_state = data["numpy"], data["python"]
        keys, internal = numpy_state["keys"], python_state["internal"]
        gauss_next = python_state["gauss_next"]
        well_formed = (
            isinstance(numpy_state["kind"], str)
            and _is_int_list(keys)
            and all(0 <= key < 2**32 for key in keys)
            and _is_int_list(internal)
            and isinstance(python_state["version"], int)
            and (gauss_next is None or isinstance(gauss_next, float))
            and isinstance(numpy_state["cached_gaussian"], float)
            and isinstance(data.get("cuda", []), list)
        )
        if not well_formed:
            raise TypeError("unexpected field types")
        state: dict[str, Any] = {
            "torch": _unb64(data["torch"], f"{source}: torch"),
            "numpy": (
                numpy_state["kind"],
                np.array(keys, dtype=np.uint32),
                int(numpy_state["pos"]),
                int(numpy_state["has_gauss"]),
                numpy_state["cached_gaussian"],
            ),
            "python": (python_state["version"], tuple(internal), gauss_next),
        }
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise TrainerCheckpointError(f"cannot read {source}: not an RNG state ({error})") from error
    if data.get("cuda"):
        state["cuda"] = [_unb64(text, f"{source}: cuda") for text in data["cuda"]]
    return state


def _legacy_rng(data: bytes, source: str) -> dict[str, Any]:
    """A format 1 ``rng.pt``: the restricted unpickler, allowing numpy's array rebuild only."""
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1
        multiarray = importlib.import_module("numpy.core.multiarray")
    _reconstruct = multiarray._reconstruct

    allowed: list[Any] = [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        _reconstruct,
        (_reconstruct, "numpy.core.multiarray._reconstruct"),  # written by numpy 1
    ]
    with torch.serialization.safe_globals(allowed):
        state = _torch_load(data, source)
    try:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        version, internal, gauss_next = state["python"]
        if not (
            isinstance(state["torch"], torch.Tensor)
            and isinstance(keys, np.ndarray)
            and keys.dtype == np.uint32
        ):
            raise TypeError("unexpected field types")
        return {
            "torch": state["torch"],
            "numpy": (str(kind), keys, int(pos), int(has_gauss), float(cached)),
            "python": (int(version), tuple(int(x) for x in internal), gauss_next),
        }
    except (KeyError, TypeError, ValueError) as error:
        raise TrainerCheckpointError(f"cannot read {source}: not an RNG state ({error})") from error


# --------------------------------------------------------------------------- capture
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
        files[RNG_FILE] = encode_rng(self.rng_state)
        files[STATE_FILE] = json.dumps(self.trainer_state, sort_keys=True, indent=1).encode()
        return files


@dataclass
class LoadedTrainerCheckpoint:
    """A committed ``step_<N>`` read back (every file verified against its marker)."""

    step: int
    uri: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, Any]
    trainer_state: dict[str, Any]
    files: dict[str, bytes]
    writer: CheckpointWriter | None = None


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _torch_load(data: bytes, what: str) -> Any:
    try:
        # weights_only: tensors and plain containers only; a file that asks for anything
        # else (a pickled callable, an arbitrary class) is refused before it is built.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise TrainerCheckpointError(f"cannot read {what}: {error}") from error


# --------------------------------------------------------------------------- the store
class TrainerCheckpointer:
    """Publishes, lists, loads and prunes ``step_<N>`` entries in one storage.

    ``writer`` is recorded in each marker (default: this pod's identity from its
    environment); ``fence`` (the Lease check) runs at each commit point.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        keep_latest: int,
        *,
        writer: CheckpointWriter | None = None,
        fence: Callable[[], None] | None = None,
    ) -> None:
        if keep_latest < 1:
            raise TrainerCheckpointError("keep_latest must be >= 1")
        self.storage = storage
        self.keep_latest = keep_latest
        self.writer = writer or CheckpointWriter.from_environment()
        self.fence = fence

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

        A step that is already committed with the same weights trajectory (an earlier
        incarnation committed it, and this one retrained through it after resuming from a
        snapshot anchored before it) is kept as it is and counts as durable. One committed
        with other weights raises :class:`CheckpointClashError`: it is not this run's anchor.
        """
        entry = step_entry(step)
        marker_key = join_key(entry, DEFAULT_MARKER)
        checksums = {name: file_digest(bytes(data)) for name, data in files.items()}
        marker = CommitMarker(
            step=step, format=TRAINER_CHECKPOINT_FORMAT, writer=self.writer, files=checksums
        )
        try:
            uri = publish_entry(
                self.storage,
                entry,
                files,
                marker_payload=marker.to_bytes(),
                before_commit=self.fence,
            )
        except ObjectExistsError:
            uri = self.storage.uri_for(marker_key)
            try:
                existing = CommitMarker.from_bytes(self.storage.read_bytes(marker_key), uri)
            except TrainerCheckpointError as error:
                theirs = f"a writer whose marker is unreadable ({error})"
                raise CheckpointClashError(
                    uri, theirs, self.writer.describe(), list(TRAJECTORY_FILES)
                ) from None
            differing = differing_trajectory_files(checksums, existing.files)
            if differing:
                raise CheckpointClashError(
                    uri, describe_writer(existing.writer), self.writer.describe(), differing
                ) from None
            logger.info(
                "trainer checkpoint %s was already committed by %s with the same weights; "
                "keeping it (this run retrained through step %d after resuming)",
                uri,
                describe_writer(existing.writer),
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
        """Read ``step_<step>``: every file checked against the marker before it is decoded.

        ``extra_names`` are read when the entry has them (absent ones are skipped). Raises
        :class:`CheckpointIntegrityError` naming a file that is missing or was changed, and
        :class:`TrainerCheckpointError` for anything else that makes the entry unreadable.
        """
        entry = step_entry(step)
        where = self.storage.uri_for(entry)
        marker_key = join_key(entry, DEFAULT_MARKER)
        try:
            raw_marker = self.storage.read_bytes(marker_key)
        except ObjectNotFoundError as error:
            raise TrainerCheckpointError(f"{where} is not committed") from error
        marker = CommitMarker.from_bytes(raw_marker, self.storage.uri_for(marker_key))
        legacy = marker.files is None
        rng_file = LEGACY_RNG_FILE if legacy else RNG_FILE
        files: dict[str, bytes] = {}
        for name in (MODEL_FILE, OPTIMIZER_FILE, rng_file, STATE_FILE):
            required = self._read_verified(entry, name, marker, required=True)
            assert required is not None
            files[name] = required
        for name in extra_names:
            data = self._read_verified(entry, name, marker, required=False)
            if data is not None:
                files[name] = data
        if legacy:
            logger.warning(
                "%s is a format %d trainer checkpoint: its marker has no checksums, so its "
                "files cannot be verified",
                where,
                LEGACY_FORMAT,
            )
        try:
            state = json.loads(files[STATE_FILE])
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TrainerCheckpointError(
                f"{where}/{STATE_FILE}: not valid JSON ({error})"
            ) from error
        expected = LEGACY_FORMAT if legacy else TRAINER_CHECKPOINT_FORMAT
        if not isinstance(state, dict) or state.get("format") != expected:
            found = state.get("format") if isinstance(state, dict) else None
            raise TrainerCheckpointError(
                f"{where}: trainer checkpoint format {found!r} in {STATE_FILE} does not match "
                f"its marker's format {expected}"
            )
        rng_source = f"{entry}/{rng_file}"
        return LoadedTrainerCheckpoint(
            step=step,
            uri=where,
            model_state=_torch_load(files[MODEL_FILE], f"{entry}/{MODEL_FILE}"),
            optimizer_state=_torch_load(files[OPTIMIZER_FILE], f"{entry}/{OPTIMIZER_FILE}"),
            rng_state=(
                _legacy_rng(files[rng_file], rng_source)
                if legacy
                else decode_rng(files[rng_file], rng_source)
            ),
            trainer_state=state,
            files=files,
            writer=marker.writer,
        )

    def _read_verified(
        self, entry: str, name: str, marker: CommitMarker, *, required: bool
    ) -> bytes | None:
        key = join_key(entry, name)
        uri = self.storage.uri_for(key)
        listed = marker.files is None or name in marker.files
        if not listed:
            if required:
                raise CheckpointIntegrityError(f"{uri}: not listed in the entry's marker")
            return None
        try:
            data = self.storage.read_bytes(key)
        except ObjectNotFoundError as error:
            if required or marker.files is not None:
                raise CheckpointIntegrityError(f"{uri}: missing from the entry") from error
            return None
        if marker.files is not None:
            expected, found = marker.files[name], file_digest(data)
            if found != expected:
                raise CheckpointIntegrityError(
                    f"{uri}: sha256 mismatch, the file was changed after its commit (marker: "
                    f"{expected['sha256'][:12]}… of {expected['bytes']} bytes, found "
                    f"{found['sha256'][:12]}… of {found['bytes']} bytes); refusing "
                    f"{self.storage.uri_for(entry)}"
                )
        return data

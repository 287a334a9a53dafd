"""Trainer checkpoints ``step_<N>``: captured under the cut, published atomically, retained.

Why two phases, why a marker that names its writer and every file's sha256, and why nothing
read can run code: see the modules behind this face, one concern each:

* :mod:`.store` — :class:`TrainerCheckpointer` (publish, list, load, prune) and the
  in-memory :class:`TrainerCapture` taken under the exclusive cut;
* :mod:`.marker` — the ``COMMITTED`` marker (:class:`CommitMarker`) and its
  :class:`CheckpointWriter`; which files fix the weights trajectory;
* :mod:`.codec` — torch files loaded ``weights_only``, the RNG state as JSON, format 1's
  pickled RNG state through a restricted unpickler;
* :mod:`.errors` — unreadable, tampered with, or another trajectory's.

File names and format versions are the storage layout's
(:mod:`rolloutrun_runtime.contract.layout`); ``step_entry`` and the file names stay
importable here for the modules that reach them through this package. Import from this face.
"""

from rolloutrun_runtime.algorithms.trainer_checkpoint.codec import (
    capture_rng,
    decode_rng,
    encode_rng,
    restore_rng,
)
from rolloutrun_runtime.algorithms.trainer_checkpoint.errors import (
    CheckpointClashError,
    CheckpointIntegrityError,
    TrainerCheckpointError,
)
from rolloutrun_runtime.algorithms.trainer_checkpoint.marker import CheckpointWriter
from rolloutrun_runtime.algorithms.trainer_checkpoint.store import (
    LoadedTrainerCheckpoint,
    TrainerCapture,
    TrainerCheckpointer,
)
from rolloutrun_runtime.contract.layout import (
    LEGACY_RNG_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    TRAINER_CHECKPOINT_FORMAT,
    step_entry,
)

__all__ = [
    "LEGACY_RNG_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "TRAINER_CHECKPOINT_FORMAT",
    "CheckpointClashError",
    "CheckpointIntegrityError",
    "CheckpointWriter",
    "LoadedTrainerCheckpoint",
    "TrainerCapture",
    "TrainerCheckpointError",
    "TrainerCheckpointer",
    "capture_rng",
    "decode_rng",
    "encode_rng",
    "restore_rng",
    "step_entry",
]

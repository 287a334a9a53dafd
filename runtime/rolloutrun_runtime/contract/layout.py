"""The storage layout: every name and format version a run writes to its storage.

Why one module: the trainer checkpointer, the snapshotter, restore and the audit all read
and write the same tree, and the audit must find what the others wrote without importing
them. A name spelled twice drifts (a snapshot file added to the writer but not to restore's
list is silently not restored), so each is spelled here once and every reader imports it.

    <storage>/
      step_<N>/                           one trainer checkpoint (format TRAINER_CHECKPOINT_FORMAT)
        model.pt  optimizer.pt  rng.json  trainer_state.json  training_journal.json
        COMMITTED                         written last: writer, per-file sha256 (the commit)
      bootstrap/ANCHOR.json               the anchor before step 1 (config fingerprint)
      rollout_snapshots/
        snapshot_<000042>/                one rollout snapshot
          files.pack                      its files (schema 3), the manifest their index:
            rollout/{controller_state,runtime_state,rollout_recovery}.json
            training_journal.json  environment/episodes.json
            data_plane/{rows.npz,metadata.json}   (rows.npz: trainer checkpoints; a snapshot's
                                          metadata.json names its rows' segments instead)
          (schemas 1-2: those files one per name, in those folders; still read)
          MANIFEST.json                   written last (create-only on GCS): the commit
        data_segments/<sha256>.npz        rows, shared by the snapshots whose manifests list them
        LATEST                            POSIX only: a hint, never trusted over listing
      gym-audit/<rollout>/<revision>.json one object per environment side effect (gs://)
      run_logs/{metrics,trace}/i<inc>-<ms>-<run id>/part-<n>.jsonl   what users watch
      run_logs/config/i<inc>-<ms>-<run id>.json                      each trainer's RunConfig
      final_model/                        a Hugging Face policy's final weights (HF layout)

Format versions are the writers' current versions; each reader says which older ones it
still reads beside its parser.
"""

from __future__ import annotations

import re

#: Under a run's log directory: its storage when ``checkpointing.storageUri`` is not set.
DEFAULT_STORAGE_DIR = "checkpoints"

# ------------------------------------------------------------------ trainer checkpoints
#: Format of a ``step_<N>`` entry: 2 adds the ``COMMITTED`` marker with per-file checksums.
TRAINER_CHECKPOINT_FORMAT = 2
#: The format before the commit marker (still read: no checksums to verify).
LEGACY_TRAINER_CHECKPOINT_FORMAT = 1
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.json"
#: Format 1's RNG file: a pickle, so it is refused rather than read (nothing is unpickled).
LEGACY_RNG_FILE = "rng.pt"
TRAINER_STATE_FILE = "trainer_state.json"
#: Trained steps since the run began: one entry per step with its groups and reward.
JOURNAL_FILE = "training_journal.json"
#: The marker ``publish_entry`` writes last; a directory without it was never committed.
COMMIT_MARKER = "COMMITTED"
STEP_ENTRY = re.compile(r"^step_(\d+)$")


def step_entry(step: int) -> str:
    """The directory of the trainer checkpoint after ``step`` optimizer steps."""
    return f"step_{step}"


# ------------------------------------------------------------------ rollout snapshots
#: Manifest schema 2 adds ``segments``: the data-plane segments the snapshot references.
#: Schema 3 adds ``pack``: the snapshot's files as one packed file (``PACK_FILE``), each file
#: record with its ``offset`` in it; schemas 1 and 2 (one file per name) are still read.
MANIFEST_SCHEMA_VERSION = 3
#: The last schema of the one-file-per-name layout (what an unpacked publication writes).
UNPACKED_MANIFEST_SCHEMA_VERSION = 2
READABLE_MANIFEST_SCHEMA_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "MANIFEST.json"
#: A schema-3 snapshot's files, concatenated in name order (the manifest is the index).
PACK_FILE = "files.pack"
SNAPSHOTS_PREFIX = "rollout_snapshots"
BOOTSTRAP_KEY = "bootstrap/ANCHOR.json"
LATEST_KEY = f"{SNAPSHOTS_PREFIX}/LATEST"
SNAPSHOT_DIR = re.compile(r"^snapshot_(\d{6,})$")
CONTROLLER_STATE_FILE = "rollout/controller_state.json"
RUNTIME_STATE_FILE = "rollout/runtime_state.json"
LEDGER_FILE = "rollout/rollout_recovery.json"
ENVIRONMENT_FILE = "environment/episodes.json"
DATA_PLANE_PREFIX = "data_plane/"
#: Content-addressed data-plane segments (``<sha256>.npz``), shared by the snapshots whose
#: manifests list them: a snapshot writes only the rows added since the last one.
DATA_SEGMENTS_PREFIX = f"{SNAPSHOTS_PREFIX}/data_segments"


def data_segment_key(sha256: str) -> str:
    """The key of the data-plane segment whose bytes hash to ``sha256``."""
    return f"{DATA_SEGMENTS_PREFIX}/{sha256}.npz"


def chain_chunk_key(sha256: str) -> str:
    """The key of a snapshot's chain chunk (:mod:`rolloutrun_runtime.json_chain`) whose
    bytes hash to ``sha256``: beside the data segments, listed, kept and collected as they are."""
    return f"{DATA_SEGMENTS_PREFIX}/{sha256}.json"


def snapshot_dir(snapshot_id: int) -> str:
    """The directory of rollout snapshot ``snapshot_id`` under the run's storage."""
    return f"{SNAPSHOTS_PREFIX}/snapshot_{snapshot_id:06d}"


# ------------------------------------------------------------------ data plane (TQ)
#: Format of a data-plane checkpoint; readers accept ``READABLE_DATA_PLANE_FORMATS``.
DATA_PLANE_FORMAT = 2
#: A snapshot's data plane as segments: ``metadata.json`` lists each row's segment.
SEGMENTED_DATA_PLANE_FORMAT = 3
#: Format 4: format 3 with the row index as a chain of chunks (only what changed is written).
CHAINED_DATA_PLANE_FORMAT = 4
READABLE_DATA_PLANE_FORMATS = (1, 2, 3, 4)
#: Format tag inside a segment (an npz whose ``index`` member is its JSON column index).
DATA_SEGMENT_FORMAT = "data-segment/1"
ROWS_FILE = "rows.npz"
DATA_PLANE_METADATA_FILE = "metadata.json"

# ------------------------------------------------------------------ recovery ledger
#: Sidecar schema 5 adds the spare-prompt pool (always present, possibly empty).
LEDGER_SCHEMA_VERSION = 5
#: Schema 6 (snapshots only): the groups as a chain of chunks (only what changed is written).
LEDGER_CHAIN_SCHEMA_VERSION = 6
READABLE_LEDGER_SCHEMA_VERSIONS = (4, 5, 6)
LEDGER_SIDECAR_NAME = "rollout_recovery.json"

#: Every file of a rollout snapshot that restore installs (the manifest lists their digests).
ROLLOUT_FILES = (
    CONTROLLER_STATE_FILE,
    RUNTIME_STATE_FILE,
    LEDGER_FILE,
    JOURNAL_FILE,
    ENVIRONMENT_FILE,
    DATA_PLANE_PREFIX + ROWS_FILE,
    DATA_PLANE_PREFIX + DATA_PLANE_METADATA_FILE,
)

# ------------------------------------------------------------------ environments (Gym)
#: Version of a Gym episode record (``Episode.to_record``); restore refuses others.
EPISODE_RECORD_VERSION = 1
#: Format tag of the episodes a Gym exports into ``environment/episodes.json``.
GYM_SNAPSHOT_FORMAT = "gym-episodes/1"
#: Under the run's storage: one object per side effect, ``<rollout>/<revision>.json``.
GYM_AUDIT_PREFIX = "gym-audit"
#: file:// audits: every file of the audit directory whose name ends so (one per replica).
AUDIT_FILE_SUFFIX = ".audit.jsonl"
GYM_AUDIT_GLOB = f"gym-*{AUDIT_FILE_SUFFIX}"
#: In the audit files' directory: the lock every replica's check-and-append takes.
AUDIT_RUN_LOCK_NAME = ".side-effects.lock"
#: Next to an audit file: the lock its single writer holds (the file names the holder).
AUDIT_WRITER_LOCK_SUFFIX = ".lock"

# ------------------------------------------------------------------ run logs
TRACE_FILE = "rollout_trace.jsonl"
METRICS_FILE = "metrics.jsonl"
FINAL_WEIGHTS_FILE = "final_weights.sha256"
#: Under the run's storage: a Hugging Face policy's final weights in the Hugging Face layout
#: (config.json, model.safetensors, tokenizer files), written when the run reaches maxSteps.
FINAL_MODEL_DIR = "final_model"
SNAPSHOTS_LOG = "snapshots.jsonl"

# ------------------------------------------------------------------ run logs in storage
#: Under the run's storage: what users watch, kept past the pod. Each log is a set of
#: segments, one per trainer process (``i<incarnation>-<start ms>-<run id>``), each a run of
#: create-once parts; readers concatenate segments in name order, parts in number order.
#: A published part is never rewritten (object stores cannot append).
LOGS_PREFIX = "run_logs"
METRICS_LOG = "metrics"
TRACE_LOG = "trace"
#: One object per trainer process: the RunConfig it ran (JSON), for audit and trace readers.
CONFIG_LOG = "config"
LOG_SEGMENT = re.compile(r"^i(\d{6})-(\d{13})-([0-9a-z]+)$")
LOG_PART = re.compile(r"^part-(\d{6})\.jsonl$")


def log_segment(incarnation: int, started_ms: int, run_id: str) -> str:
    """A process's segment name: sorts by incarnation, then start time."""
    return f"i{incarnation:06d}-{started_ms:013d}-{run_id}"


def log_prefix(log: str) -> str:
    """Where log ``log`` (``METRICS_LOG``, ``TRACE_LOG``) keeps its segments."""
    return f"{LOGS_PREFIX}/{log}/"


def log_part_key(log: str, segment: str, part: int) -> str:
    """Part ``part`` (from 1) of a segment of log ``log``."""
    return f"{log_prefix(log)}{segment}/part-{part:06d}.jsonl"


def config_key(segment: str) -> str:
    """The RunConfig (JSON) the trainer process of ``segment`` ran."""
    return f"{log_prefix(CONFIG_LOG)}{segment}.json"

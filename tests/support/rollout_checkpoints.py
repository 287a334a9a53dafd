"""Helpers for the rollout-checkpointing tests: a real controller with real checkpoints.

Everything runs for real on the test's event loop: Gym servers (with the checkpoint control
plane for turn level), in-process generation workers, the controller, file:// storage. A
"stopped" run is a controller task cancelled without a final save, as a crash would leave it
(the pumps stop where they are; only what was published survives).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from rolloutrun_runtime.algorithms.single_controller import NoHooks, SingleController
from rolloutrun_runtime.algorithms.trainer_checkpoint import TrainerCheckpointer
from rolloutrun_runtime.contract.layout import (
    CONTROLLER_STATE_FILE,
    TRAINER_STATE_FILE,
    snapshot_dir,
)
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.checkpointing import build_environment_checkpoint
from rolloutrun_runtime.policy.model import build_model, state_sha256
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.storage import open_storage
from rolloutrun_runtime.workers import build_workers
from tests.support import run_configs

#: Generous bound on a tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 120
GYM_TOKEN = "test-token"


#: What the checkpointing tests change in :func:`tests.support.run_configs.tiny_config`.
_CHECKPOINT_RUN: dict[str, Any] = {
    "name": "ckpt",
    "grpo": {"maxSteps": 5},
    "checkpointing": {"snapshotIntervalSeconds": 0, "trace": False},
}


def tiny_config(tmp_path: Path, **sections: Any) -> RunConfig:
    """A small arithmetic run with snapshots on (the pump's timer off: tests attempt them)."""
    for section, values in _CHECKPOINT_RUN.items():
        given = sections.get(section)
        if isinstance(values, dict) and isinstance(given, dict):
            sections[section] = {**values, **given}
        elif given is None:
            sections[section] = values
    return run_configs.tiny_config(tmp_path, **sections)


class Harness:
    """Starts Gym servers once; builds controllers (one per incarnation) on shared storage."""

    def __init__(self) -> None:
        self.runners: list[Any] = []
        self.workers: list[Any] = []
        self.environments: list[Any] = []
        self.records: list[dict[str, Any]] = []
        self.published: list[dict[str, Any]] = []

    async def start_gyms(self, cfg: RunConfig) -> RunConfig:
        from rolloutrun_runtime.environments.gym import GymServer
        from rolloutrun_runtime.environments.gym.control import GymCheckpointControl
        from rolloutrun_runtime.policy.http import serve_app

        urls = []
        for index in range(cfg.gym.replicas):
            server = GymServer(f"gym-{index}", cfg, None)
            control = GymCheckpointControl(server, GYM_TOKEN)
            server.continue_restored = control.claim_restored
            runner, url = await serve_app(server.app)
            self.runners.append(runner)
            urls.append(url)
        return cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"endpoints": urls})})

    async def controller(
        self,
        cfg: RunConfig,
        *,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        fence: Callable[[], None] | None = None,
        trace: Any = None,
    ) -> SingleController:
        """A fresh incarnation: initial weights from the seed, workers, storage."""
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.policy, TOKENIZER.vocab_size, cfg.seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.grpo.learning_rate)
        workers = build_workers(cfg, model.state_dict(), 0)
        await workers.start()
        self.workers.append(workers)
        storage = open_storage(cfg.resolved_storage_uri())
        environment = build_environment_checkpoint(
            cfg, {f"gym-{i}": url for i, url in enumerate(cfg.gym.endpoints)}, GYM_TOKEN
        )
        self.environments.append(environment)
        return SingleController(
            cfg,
            model=model,
            optimizer=optimizer,
            workers=workers,
            gym_endpoints=list(cfg.gym.endpoints),
            checkpointer=TrainerCheckpointer(storage, cfg.checkpointing.keep_latest),
            pad_id=TOKENIZER.pad_id,
            manifests=ManifestStore(storage, cfg.name),
            environment=environment,
            hooks=_HarnessHooks(self, on_step, fence),
            trace=trace,
        )

    async def close(self) -> None:
        for workers in self.workers:
            await workers.stop()
        for environment in self.environments:
            await environment.close()
        for runner in self.runners:
            await runner.cleanup()


class _HarnessHooks(NoHooks):
    """The test's ``on_step`` and ``fence``; published manifests and snapshot records are
    collected on the harness."""

    def __init__(
        self,
        harness: Harness,
        on_step: Callable[[dict[str, Any]], None] | None,
        fence: Callable[[], None] | None,
    ) -> None:
        self.harness = harness
        self._on_step = on_step
        self._fence = fence

    def fence(self) -> None:
        if self._fence is not None:
            self._fence()

    def on_step(self, record: dict[str, Any]) -> None:
        if self._on_step is not None:
            self._on_step(record)

    def on_published(self, published: dict[str, Any]) -> None:
        self.harness.published.append(published)

    def on_snapshot(self, record: dict[str, Any]) -> None:
        self.harness.records.append(record)


@asynccontextmanager
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        await h.close()


async def run_to_end(controller: SingleController) -> None:
    await asyncio.wait_for(controller.run(), RUN_LIMIT_S)


async def run_until_stopped(controller: SingleController, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set, then cancel the controller: no final save (a crash)."""
    task = asyncio.ensure_future(controller.run())
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait(
        {task, stopper}, timeout=RUN_LIMIT_S, return_when=asyncio.FIRST_COMPLETED
    )
    assert done, "the run neither finished nor reached its stop"
    task.cancel()
    stopper.cancel()
    await asyncio.gather(task, stopper, return_exceptions=True)


def snapshot_after_commits(
    controller: SingleController,
    steps: set[int],
    outcomes: list[Any],
    stop: frozenset[int] | set[int] = frozenset(),
) -> asyncio.Event:
    """Right after each listed step commits (inside the train pump, so at exactly that
    step), force a snapshot attempt and record its outcome; returns an event set after a
    step in ``stop`` commits (for ``run_until_stopped``)."""
    original = controller.train_pump.commit_step
    stopped = asyncio.Event()

    async def commit_then_snapshot(selected: Any) -> None:
        await original(selected)
        if selected.step in steps:
            outcomes.append(await controller.rollout_snapshots.attempt(force=True, reason="test"))
        if selected.step in stop:
            stopped.set()

    controller.train_pump.commit_step = commit_then_snapshot  # type: ignore[method-assign]
    return stopped


async def crash_after_snapshot(
    controller: SingleController, snapshot_at: int = 2, stop_at: int = 3
) -> None:
    """Snapshot right after step ``snapshot_at`` commits, then stop without a final save
    after step ``stop_at`` (a crash); the snapshot must have published."""
    outcomes: list[Any] = []
    stop = snapshot_after_commits(controller, {snapshot_at}, outcomes, stop={stop_at})
    await run_until_stopped(controller, stop)
    assert outcomes == [SnapshotOutcome.PUBLISHED]


def final_journal(cfg: RunConfig) -> dict[str, Any]:
    """``training_journal.json`` of the final trainer checkpoint."""
    checkpointer = TrainerCheckpointer(open_storage(cfg.resolved_storage_uri()), 10)
    step = checkpointer.latest_step()
    assert step == cfg.grpo.max_steps, f"final checkpoint is step_{step}"
    return json.loads(checkpointer.storage.read_bytes(f"step_{step}/training_journal.json"))


def assert_each_step_once_no_prompt_twice(journal: dict[str, Any], max_steps: int) -> None:
    """The journal lists steps 1..max once each and never trains (or drops) a prompt twice."""
    assert journal["schema"] == 1
    assert [s["step"] for s in journal["steps"]] == list(range(1, max_steps + 1))
    for entry in journal["steps"]:
        assert entry["weight_version_before"] == entry["step"] - 1
    prompts = Counter(
        (g["epoch"], g["prompt_id"])
        for entry in journal["steps"]
        for g in [*entry["groups"], *entry["dropped"]]
    )
    assert prompts and max(prompts.values()) == 1, prompts.most_common(3)
    groups = Counter(g["group_id"] for entry in journal["steps"] for g in entry["groups"])
    assert max(groups.values()) == 1


def weights_digest(controller: SingleController) -> str:
    return state_sha256(controller.model.state_dict())


async def two_snapshots(h, cfg):
    """A finished 2-step run with snapshots after step 1 (bootstrap anchor) and after the end
    (anchored to step_2)."""
    controller = await h.controller(cfg)
    outcomes: list = []
    snapshot_after_commits(controller, {1}, outcomes)
    await run_to_end(controller)
    assert outcomes == [SnapshotOutcome.PUBLISHED]
    assert await controller.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
    return ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)


def republish(store: ManifestStore, cfg, source_id: int, *, pack: bool = True, **replace: bytes):
    """Publish a copy of snapshot ``source_id`` with some files replaced (valid checksums);
    ``pack`` False: in the layout before packed files (one object per name, schema 2)."""
    manifest = store.load_manifest(source_id)
    entry = snapshot_dir(source_id)
    files = {name: snapshot_file(store.storage, entry, name) for name in manifest.files}
    files.update(replace)
    return store.publish(
        config=cfg,
        anchor=manifest.anchor,
        files=files,
        train_step=manifest.train_step,
        mutation_version=manifest.mutation_version,
        cut_time=manifest.cut_time,
        segments=manifest.segments,  # the data-plane segments it shares (already stored)
        pack=pack,
    )


def republish_checkpoint(cfg: RunConfig, step: int, edit: Callable[[dict[str, Any]], None]) -> str:
    """``step_<step>``: a copy of the newest trainer checkpoint whose trainer and controller
    states ``edit`` rewrites in place (written under another config, by another release);
    returns its URI."""
    checkpointer = TrainerCheckpointer(open_storage(cfg.resolved_storage_uri()), keep_latest=9)
    source = checkpointer.latest_step()
    assert source is not None and source < step
    prefix = f"step_{source}/"
    files = {
        key.removeprefix(prefix): checkpointer.storage.read_bytes(key)
        for key in checkpointer.storage.list(prefix.rstrip("/"))
        if not key.endswith("COMMITTED")
    }
    for name in (TRAINER_STATE_FILE, CONTROLLER_STATE_FILE):
        if name in files:
            state = json.loads(files[name])
            edit(state)
            files[name] = json.dumps(state).encode()
    checkpointer.publish_files(step, files)
    return checkpointer.storage.uri_for(f"step_{step}")


def snapshot_ledger_chunks(storage, raw: bytes) -> dict[str, bytes]:
    """The chunks a snapshot's ledger head (schema 6) lists, read from storage."""
    from rolloutrun_runtime.experience.rollout_recovery.sidecar import chain_keys

    return {key: storage.read_bytes(key) for key in chain_keys(raw)}


def snapshot_file(storage, entry: str, name: str) -> bytes:
    """File ``name`` of the committed snapshot at ``entry``, checked, in either layout (its
    own object, or its slice of the pack)."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
        ManifestStore,
        parse_snapshot_id,
    )

    snapshot_id = parse_snapshot_id(entry)
    assert snapshot_id is not None, f"{entry} is not a snapshot's folder"
    return ManifestStore(storage, "").read_committed_file(snapshot_id, name)


def tamper_snapshot_file(storage, entry: str, name: str, data: bytes) -> None:
    """Replace file ``name`` of the committed snapshot at ``entry`` behind its manifest's
    back: its own object, or its slice of the pack (what follows it shifts)."""
    manifest = json.loads(storage.read_bytes(f"{entry}/MANIFEST.json"))
    if not manifest.get("pack"):
        storage.write_bytes(f"{entry}/{name}", data)
        return
    key, record = f"{entry}/{manifest['pack']}", manifest["files"][name]
    pack, start = storage.read_bytes(key), record["offset"]
    storage.write_bytes(key, pack[:start] + data + pack[start + record["bytes"] :])


def whole_ledger(storage, entry: str) -> dict[str, Any]:
    """A snapshot's ledger sidecar as one whole document (schema 5: what a test edits and
    republishes as the entry's ``LEDGER_FILE``)."""
    from rolloutrun_runtime.contract.layout import LEDGER_FILE, LEDGER_SCHEMA_VERSION
    from rolloutrun_runtime.experience.rollout_recovery.sidecar import sidecar_document

    raw = snapshot_file(storage, entry, LEDGER_FILE)
    document = sidecar_document(raw, snapshot_ledger_chunks(storage, raw))
    return {**document, "schema_version": LEDGER_SCHEMA_VERSION}

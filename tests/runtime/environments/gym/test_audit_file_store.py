"""The ``--audit-file`` side-effect store: run-wide refusal across the replicas' files of one
directory, fsynced appends, a torn tail cut on open, and one writer per file (issue 10,
findings 1 and 10).

The policy is the real generation engine with scripted weights (each turn answers ``+1``),
called in process; every ``reach_target`` turn applies one known side effect.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime import audit as A
from rolloutrun_runtime.environments.gym import SideEffectLog, SideEffectReplayError
from rolloutrun_runtime.environments.gym.effects import (
    AuditFileBusyError,
    AuditFileStore,
    SideEffectStorageError,
)
from rolloutrun_runtime.environments.gym.episode import Phase
from rolloutrun_runtime.policy.generation import GenerationEngine
from tests.support.scripted_gym import agent, fresh_episode


def replica(directory: Path, index: int) -> SideEffectLog:
    name = f"gym-{index}"
    return SideEffectLog(name, store=AuditFileStore(directory / f"{name}.audit.jsonl"))


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def line(rollout_id: str, revision: int) -> str:
    entry = {"rollout_id": rollout_id, "revision": revision, "attempt": 0, "turn": revision - 1}
    return json.dumps(entry, sort_keys=True) + "\n"


async def test_an_effect_applied_on_one_replica_is_refused_on_another(
    tmp_path: Path, engine: GenerationEngine
) -> None:
    """Both replicas up, the second opened before the first applied: its check-and-append
    reads the other replica's file under the run lock."""
    gym0, gym1 = replica(tmp_path, 0), replica(tmp_path, 1)
    try:
        assert gym1.applied_revision("r") == 0
        done = await agent(engine, gym0).run(fresh_episode(agent(engine, gym0), "r"))
        assert done.revision == 3
        relaunched = fresh_episode(agent(engine, gym1), "r")
        with pytest.raises(SideEffectReplayError, match=r"recorded at .*gym-0\.audit\.jsonl"):
            await agent(engine, gym1).run(relaunched)
        assert relaunched.phase is Phase.FAILED and relaunched.state["counter"] == 0
        assert (tmp_path / "gym-1.audit.jsonl").read_text() == ""
        gym1.refresh()  # what a restore does before deciding
        assert gym1.applied_revision("r") == 3
    finally:
        gym0.close()
        gym1.close()
    # A replica started later reads every replica's file of the directory.
    late = replica(tmp_path, 2)
    assert late.applied_revision("r") == 3
    late.close()


def test_a_torn_tail_is_cut_on_open_and_the_next_record_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the next record was glued onto the torn tail and both were lost on reload."""
    path = tmp_path / "gym-0.audit.jsonl"
    path.write_text(line("r", 1) + line("r", 2)[:17])
    store = AuditFileStore(path)
    assert "cut a torn tail of 17 bytes after line 1" in caplog.text
    assert store.load() == {"r": 1}
    store.write(json.loads(line("r", 2)))
    store.close()
    assert path.read_text() == line("r", 1) + line("r", 2)
    reopened = AuditFileStore(path)
    assert reopened.load() == {"r": 2}
    reopened.close()
    _, torn = A.load_side_effects(tmp_path, _NoObjects())
    assert torn == A.TornRecords()


def test_a_second_writer_of_one_file_is_excluded_naming_the_first(tmp_path: Path) -> None:
    path = tmp_path / "gym-0.audit.jsonl"
    first = AuditFileStore(path)
    with pytest.raises(AuditFileBusyError, match=rf"another writer holds .*pid {os.getpid()}"):
        AuditFileStore(path)
    first.write(json.loads(line("r", 1)))
    first.close()
    second = AuditFileStore(path)  # the first one exited: the lock is free
    assert second.load() == {"r": 1}
    second.close()


def test_every_append_is_fsynced_and_a_failed_one_leaves_no_torn_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gym-0.audit.jsonl"
    store = AuditFileStore(path)
    synced: list[int] = []
    real_fsync, real_write = os.fsync, os.write
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store.write(json.loads(line("r", 1)))
    assert len(synced) == 1

    def half_then_fail(fd: int, data: Any) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_fail)
    log = SideEffectLog("gym-0", store=store)
    with pytest.raises(SideEffectStorageError, match="No space left on device"):
        log.persist(json.loads(line("s", 1)))
    monkeypatch.setattr(os, "write", real_write)
    assert path.read_text() == line("r", 1)  # the partial line was cut
    store.write(json.loads(line("s", 2)))
    store.close()
    assert [(e["rollout_id"], e["revision"]) for e in lines_of(path)] == [("r", 1), ("s", 2)]


class _NoObjects:
    """A storage without ``gym-audit/`` objects (the audit then reads only the files)."""

    def list(self, prefix: str = "") -> list[str]:
        return []

"""Run logs in the run's storage (``run_logs/<log>/<segment>/part-<n>.jsonl``) on both backends,
and ``rolloutrun audit`` / ``rolloutrun trace`` given nothing but a storage URI.

Before: metrics and the trace lived only in the log directory (an emptyDir on a cluster),
and ``rolloutrun audit gs://...`` took the URI for a directory and found no checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.cli import main as rolloutrun
from rolloutrun_runtime.contract.layout import METRICS_LOG, log_segment
from rolloutrun_runtime.run_logs import LogShipper, read_latest_config, read_log_lines
from tests.support.audit_runs import write_stored_run


def test_each_process_ships_its_own_segment_of_create_once_parts(storage: Any, tmp_path: Path):
    first, second = tmp_path / "pod-0.jsonl", tmp_path / "pod-1.jsonl"
    first.write_text('{"old": "lines of an earlier process in this file are not shipped"}\n')
    # Incarnation 1 started earlier by the clock than incarnation 0's replacement? Names
    # sort by incarnation first, then start time.
    zero = LogShipper(storage, METRICS_LOG, first, log_segment(0, 5_000, "a"))
    one = LogShipper(storage, METRICS_LOG, second, log_segment(1, 4_000, "b"))
    with first.open("a") as out:
        out.write('{"step": 1}\n{"step": 2}\n{"step": 3')  # the third line is still being written
    assert zero.ship() > 0
    parts = {key: storage.read_bytes(key) for key in storage.list("run_logs/")}
    assert read_log_lines(storage, METRICS_LOG) == ['{"step": 1}', '{"step": 2}']
    with first.open("a") as out:
        out.write("}\n")
    zero.close()
    second.write_text('{"step": 4}\n')
    one.close()
    assert [json.loads(line)["step"] for line in read_log_lines(storage, METRICS_LOG)] == [
        1,
        2,
        3,
        4,
    ]
    # a published part is never rewritten: later lines went into new parts
    for key, data in parts.items():
        assert storage.read_bytes(key) == data
    assert len(storage.list("run_logs/")) == 3
    assert zero.ship() == 0  # nothing new: no empty part


def test_audit_and_trace_read_everything_from_a_storage_uri(
    storage: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, fake_gcs: Any
):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)  # the CLI's own gs:// client
    write_stored_run(storage, tmp_path / "scratch")
    uri = storage.base_uri
    assert read_latest_config(storage) is not None

    assert rolloutrun(["audit", uri, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == uri + "/step_1"
    assert report["side_effects"]["applied"] == 1  # gym-audit/gym-0.audit.jsonl in storage
    assert report["max_steps"] == 1  # from the RunConfig the trainer kept

    assert rolloutrun(["trace", uri, "--json"]) == 0
    trace = json.loads(capsys.readouterr().out)
    assert trace["runs"] == ["r0", "r1"]
    assert trace["thrown_away_s_total"] == pytest.approx(2.0)


def test_a_storage_without_a_trace_says_so(tmp_path: Path, capsys: Any):
    assert rolloutrun(["trace", f"file://{tmp_path}"]) == 2
    assert "no rollout trace in the run's storage" in capsys.readouterr().out


def test_a_target_is_a_directory_a_uri_or_a_run_never_two(tmp_path: Path, capsys: Any):
    assert rolloutrun(["audit", str(tmp_path), "--run", "demo"]) == 2
    assert "exactly one of" in capsys.readouterr().err

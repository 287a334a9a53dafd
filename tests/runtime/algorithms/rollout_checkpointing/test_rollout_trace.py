"""The rollout trace: writing, torn lines, per-stop costs, batch age, the CLI and the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import (
    TraceWriter,
    analyze,
    batch_age_by_step,
    read_events,
)
from rolloutrun_runtime.contract.layout import TRACE_FILE


def ev(t, run_id, event, **fields):
    return {"t": t, "run_id": run_id, "event": event, **fields}


def dispatched(t, run, uuid, prompt, gen=0):
    return ev(
        t,
        run,
        "attempt_dispatched",
        group_id="g",
        prompt_id=prompt,
        generation_index=gen,
        attempt_uuid=uuid,
        gym_instance_id="gym-0",
        gym_attempt=0,
    )


def stopped_trace():
    return [
        ev(
            0.0,
            "r1",
            "run_started",
            incarnation=0,
            resumed_from=None,
            snapshot_id=None,
            cut_time=None,
        ),
        dispatched(1.0, "r1", "a1", prompt=7),
        dispatched(2.0, "r1", "a2", prompt=8),
        ev(
            3.0,
            "r1",
            "attempt_sealed",
            group_id="g",
            prompt_id=8,
            generation_index=0,
            attempt_uuid="a2",
        ),
        ev(3.5, "r1", "group_sealed", group_id="g", prompt_id=8),
        ev(
            4.0,
            "r1",
            "snapshot_published",
            snapshot_id=1,
            anchor="bootstrap",
            cut_time=4.0,
            manifest_uri="file:///x",
        ),
        # killed at ~5.0; resumed:
        ev(
            10.0,
            "r2",
            "run_started",
            incarnation=1,
            resumed_from="file:///x",
            snapshot_id=1,
            cut_time=4.0,
        ),
        ev(
            10.1,
            "r2",
            "attempt_abandoned",
            group_id="g",
            prompt_id=7,
            generation_index=0,
            attempt_uuid="a1",
            reason="restart",
        ),
        dispatched(10.2, "r2", "a3", prompt=7),
        ev(12.0, "r2", "group_sealed", group_id="g", prompt_id=7),
        ev(
            13.0,
            "r2",
            "group_trained",
            group_id="g",
            prompt_id=7,
            step=2,
            tokens_by_version={"0": 10, "1": 30},
        ),
    ]


def test_thrown_away_time_is_dispatch_to_cut_of_abandoned_attempts():
    report = analyze(stopped_trace())
    assert report.runs == ["r1", "r2"]
    (stop,) = report.stops
    assert stop.abandoned_attempts == 1
    assert stop.thrown_away_s == pytest.approx(3.0)  # dispatched at 1.0, cut at 4.0
    assert stop.restored_snapshot_id == 1
    assert stop.lost_progress_s is None


def test_lost_progress_against_a_baseline():
    baseline = [
        ev(
            0.0,
            "b",
            "run_started",
            incarnation=0,
            resumed_from=None,
            snapshot_id=None,
            cut_time=None,
        ),
        ev(5.0, "b", "group_sealed", group_id="x", prompt_id=7),
    ]
    (stop,) = analyze(stopped_trace(), baseline).stops
    assert stop.lost_progress_s == pytest.approx(12.0 - 5.0)


def test_lost_progress_matches_a_prompt_of_the_same_epoch():
    """A prompt drawn again in a later epoch is another group: the stopped run's epoch-0
    group compares with the baseline's epoch-0 sealing, not the epoch-1 one."""
    baseline = [
        ev(0.0, "b", "run_started", incarnation=0, resumed_from=None, snapshot_id=None),
        ev(5.0, "b", "group_sealed", group_id="x", prompt_id=7, epoch=0),
        ev(11.0, "b", "group_sealed", group_id="y", prompt_id=7, epoch=1),
    ]
    (stop,) = analyze(stopped_trace(), baseline).stops
    assert stop.lost_progress_s == pytest.approx(12.0 - 5.0)


def test_batch_age_is_token_weighted():
    # Step 2 trains with version 1: version-0 tokens are 1 update old, version-1 tokens 0.
    assert batch_age_by_step(stopped_trace()) == {2: pytest.approx(10 / 40)}


def test_writer_appends_flushed_lines_and_reader_skips_a_torn_one(tmp_path):
    path = tmp_path / TRACE_FILE
    writer = TraceWriter(path, run_id="r1")
    writer.emit("snapshot_skipped", reason="nothing changed")
    with pytest.raises(ValueError, match="unknown trace event"):
        writer.emit("made_up")
    writer.close()
    with path.open("a") as handle:
        handle.write('{"t": 1, "run_id": "r1", "ev')  # killed mid-line
    events = list(read_events(path))
    assert [e["event"] for e in events] == ["snapshot_skipped"]
    assert TraceWriter(None).enabled is False


def test_cli_prints_json_and_draws_the_plot(tmp_path):
    path = tmp_path / TRACE_FILE
    path.write_text("".join(json.dumps(e) + "\n" for e in stopped_trace()))
    plot = tmp_path / "attempts.png"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rolloutrun_runtime.cli",
            "trace",
            str(tmp_path),
            "--json",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    assert data["thrown_away_s_total"] == pytest.approx(3.0)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_names_a_missing_trace(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "trace", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "no rollout trace" in result.stdout

"""bench/rollout_checkpoint.py: the multi-seed kill plan and summary, and ``--quick`` run
whole (its JSON shape, both sides measured and audited; never a timing)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.rollout_checkpoint import QUICK_KILLS, kill_moments, summarize

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed", range(1, 8))
def test_kill_moments_land_next_to_a_trainer_checkpoint_and_across_the_run(seed: int) -> None:
    moments = kill_moments(seed, 6, 40, 10)
    assert moments == kill_moments(seed, 6, 40, 10), "both sides of a seed get the same moments"
    assert len(moments) == 6 and moments == sorted(moments)
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(moments))
    assert all(1.0 <= m < 40 for m in moments)
    assert any(round(m - 0.05, 6) in (10, 20, 30) for m in moments), "right after a save"
    assert any(round(m + 0.05, 6) in (10, 20, 30, 40) for m in moments), "right before one"
    assert kill_moments(2, 2, 8, 4) == [4.05, 7.95]


def _row(lost: float) -> dict[str, object]:
    return {"mean_lost_s_per_kill": lost, "audit_ok": True}


def test_the_summary_states_the_ratio_at_the_worst_seed() -> None:
    summary = summarize(
        {
            "snapshots": {1: _row(1.0), 2: _row(2.0), 3: _row(0.5)},
            "trainer_checkpoints_only": {1: _row(30.0), 2: _row(20.0), 3: _row(25.0)},
        }
    )
    assert summary["ratio_per_seed"] == {"1": 30.0, "2": 10.0, "3": 50.0}
    assert summary["reduction"] == 10.0 and summary["reduction_worst_seed"] == 2
    assert summary["reduction_worst_vs_worst"] == 10.0  # 20 / 2
    assert summary["snapshots"]["lost_s_per_kill"]["worst_seed"] == 2
    assert summary["trainer_checkpoints_only"]["lost_s_per_kill"]["worst_seed"] == 2
    assert summary["snapshots"]["lost_s_per_kill"]["mean"] == pytest.approx(3.5 / 3, abs=1e-3)
    assert summary["met"] is False


# Two kill campaigns, about a minute of CPU: `make chaos` (run --quick by hand on a change to
# the checkpointing path).
@pytest.mark.chaos
def test_quick_measures_both_sides_and_prints_the_json(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.rollout_checkpoint",
            "--quick",
            "--parts",
            "thrown_away",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    thrown = report["thrown_away"]
    assert report["quick"] is True and thrown["seeds"] == [1]
    for side in ("snapshots", "trainer_checkpoints_only"):
        row = thrown[side]["per_seed"]["1"]
        assert row["kills"] == QUICK_KILLS and row["audit_ok"] is True
        assert len(row["per_kill"]) == QUICK_KILLS
        assert {"lost_s", "since_cut_s", "in_flight_at_stop"} <= set(row["per_kill"][0])
        assert thrown[side]["lost_s_per_kill"]["worst_seed"] == 1
    assert set(thrown["ratio_per_seed"]) == {"1"} and "reduction" in thrown


def test_the_write_part_measures_a_snapshot_that_writes_only_the_churned_rows() -> None:
    """``--parts write``'s sample on this tree (shape and the rows written, never a time):
    each snapshot after the first writes the replaced groups' rows, not the buffer."""
    import asyncio

    from bench.rollout_checkpoint import GROUP_SIZE, _write_samples

    sample = asyncio.run(_write_samples(100, 2, 5, pre_cut_yield=True))
    assert sample["rows_written_p50"] == 5 * GROUP_SIZE
    assert sample["write_and_publish"]["n"] == sample["pause_wall"]["n"] == 2
    assert sample["pause_cpu"]["p50_ms"] > 0

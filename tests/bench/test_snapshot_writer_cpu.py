"""bench/snapshot_writer_cpu.py ``--control-cycles``: a snapshot environment phase's fixed
cost, measured against a real Gym replica (the figures themselves are never judged here)."""

from __future__ import annotations

from bench.snapshot_writer_cpu import control_one


async def test_a_control_cycle_run_drives_a_real_gym_and_reports_both_sides() -> None:
    got = await control_one(5)
    assert got["cycles"] == 5
    assert got["trainer_loop_ms"] > 0 and got["gym_ms"] >= 0
    assert abs(got["total_ms"] - got["trainer_loop_ms"] - got["gym_ms"]) < 0.01

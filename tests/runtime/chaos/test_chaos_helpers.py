"""The chaos harness's pure parts: kill planning, restore cut times, lost rollout work; and
that every named crash site is placed in the runtime and every placed name is known."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from rolloutrun_runtime import chaos
from rolloutrun_runtime.chaos.cli import lost_words
from rolloutrun_runtime.crash import CRASH_SITES

RUNTIME = Path(__file__).resolve().parents[3] / "runtime" / "rolloutrun_runtime"


def _placed_sites() -> dict[str, list[str]]:
    placed: dict[str, list[str]] = {}
    for path in RUNTIME.rglob("*.py"):
        if path.name == "crash.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "crash_point"
            ):
                arg = node.args[0]
                name = arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg)
                placed.setdefault(str(name), []).append(f"{path.name}:{node.lineno}")
    return placed


def test_every_named_site_is_placed_and_every_placed_name_is_known() -> None:
    placed = _placed_sites()
    assert sorted(set(placed) - set(CRASH_SITES)) == []
    assert sorted(set(CRASH_SITES) - set(placed)) == []


@pytest.mark.parametrize(("steps_left", "kills_left"), [(10, 1), (10, 4), (3, 5), (1, 1)])
def test_kill_plans_leave_room_for_the_remaining_kills(steps_left: int, kills_left: int) -> None:
    rng = random.Random(0)
    plans = {chaos.plan_steps_before_kill(rng, steps_left, kills_left) for _ in range(200)}
    assert min(plans) >= 1
    assert max(plans) <= max(1, steps_left // (kills_left + 1))


def _ev(t: float, run: str, event: str, **fields: object) -> dict:
    return {"t": t, "run_id": run, "event": event, **fields}


def test_restore_cut_of_a_trainer_checkpoint_is_when_its_step_completed() -> None:
    events = [
        _ev(0.0, "a", "run_started", resumed_from=None, cut_time=None),
        _ev(1.0, "a", "step_completed", step=1),
        _ev(2.0, "a", "step_completed", step=2),
        _ev(3.0, "b", "run_started", resumed_from="file:///x/checkpoints/step_2", cut_time=None),
        _ev(5.0, "c", "run_started", resumed_from="snap", snapshot_id=4, cut_time=4.5),
    ]
    assert chaos.restore_cut_times(events) == {"a": None, "b": 2.0, "c": 4.5}


def test_lost_work_counts_after_the_cut_and_abandoned_before_it() -> None:
    stopped = [
        _ev(0.0, "a", "attempt_dispatched", attempt_uuid="kept"),
        _ev(1.0, "a", "attempt_sealed", attempt_uuid="kept"),  # sealed before the cut: kept
        _ev(1.5, "a", "attempt_dispatched", attempt_uuid="inflight"),  # abandoned: 0.5 + 2
        _ev(2.5, "a", "attempt_dispatched", attempt_uuid="after"),  # after the cut: 1.0
        _ev(3.5, "a", "attempt_sealed", attempt_uuid="after"),
        _ev(4.0, "a", "step_completed", step=3),
    ]
    resumed = [_ev(5.0, "b", "attempt_abandoned", attempt_uuid="inflight", reason="restart")]
    assert chaos.rollout_work_lost(stopped, resumed, 2.0) == pytest.approx(2.5 + 1.0)
    # A turn-level restore continues the in-flight attempt: only its time after the cut.
    assert chaos.rollout_work_lost(stopped, [], 2.0) == pytest.approx(2.0 + 1.0)
    # A fresh start keeps nothing.
    assert chaos.rollout_work_lost(stopped, resumed, None) == pytest.approx(1.0 + 2.5 + 1.0)


def test_unknown_site_is_refused_before_anything_runs(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("seed: 1\n")
    with pytest.raises(chaos.ChaosError, match="unknown crash site"):
        chaos.run_chaos(config, tmp_path / "run", kills=1, site="nope")
    assert not (tmp_path / "run").exists()


def test_a_used_log_dir_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("seed: 1\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(chaos.ChaosError, match="not empty"):
        chaos.run_chaos(config, tmp_path / "run", kills=1)


def test_a_restored_attempt_loses_at_most_what_the_resumed_run_redid() -> None:
    """Issue 15: an attempt restored at its turn from the replica's own newer state (or its
    result, finished after the cut) costs what the resumed run spent to seal it, when that
    is less than its time after the cut; unsealed there, it gets no credit."""
    stopped = [
        _ev(1.0, "a", "attempt_dispatched", attempt_uuid="fast"),
        _ev(1.0, "a", "attempt_dispatched", attempt_uuid="slow"),
        _ev(1.0, "a", "attempt_dispatched", attempt_uuid="unsealed"),
        _ev(4.0, "a", "attempt_sealed", attempt_uuid="fast"),  # 2.0 after the cut at 2.0
        _ev(5.0, "a", "step_completed", step=2),  # the stop: slow, unsealed 3.0 after the cut
    ]
    resumed = [
        _ev(6.0, "b", "attempt_restored", attempt_uuid=u, level="turn")
        for u in ("fast", "slow", "unsealed")
    ]
    resumed += [
        _ev(6.1, "b", "attempt_dispatched", attempt_uuid="fast"),
        _ev(6.1, "b", "attempt_dispatched", attempt_uuid="slow"),
        _ev(6.1, "b", "attempt_dispatched", attempt_uuid="unsealed"),
        _ev(6.2, "b", "attempt_sealed", attempt_uuid="fast"),  # handed back: 0.1 redone
        _ev(10.1, "b", "attempt_sealed", attempt_uuid="slow"),  # 4.0 redone > 3.0: 3.0
    ]
    assert chaos.rollout_work_lost(stopped, resumed, 2.0) == pytest.approx(0.1 + 3.0 + 3.0)


def test_a_kill_plan_is_one_moment_per_kill_inside_the_run_a_step_apart() -> None:
    from rolloutrun_runtime.chaos.campaign import check_kill_plan

    assert check_kill_plan([9.95, 3.5], 2, 10, None) == [3.5, 9.95]
    for plan, kills, why in [
        ([3.5], 2, "1 moments for 2 kills"),
        ([3.5, 4.0], 2, "one step apart"),
        ([3.5, 10.0], 2, "must lie in"),
    ]:
        with pytest.raises(chaos.ChaosError, match=why):
            check_kill_plan(plan, kills, 10, None)
    with pytest.raises(chaos.ChaosError, match="exclusive"):
        check_kill_plan([3.5], 1, 10, "after_manifest_write")


def test_the_trace_counts_attempts_in_flight_at_a_stop_and_the_cut_age() -> None:
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import analyze

    events = [
        _ev(0.0, "a", "run_started", resumed_from=None, cut_time=None),
        _ev(1.0, "a", "attempt_dispatched", attempt_uuid="x"),
        _ev(1.0, "a", "attempt_dispatched", attempt_uuid="y"),
        _ev(1.5, "a", "attempt_failed", attempt_uuid="y"),
        _ev(2.0, "a", "attempt_dispatched", attempt_uuid="z"),
        _ev(2.5, "a", "attempt_sealed", attempt_uuid="z"),
        _ev(3.0, "b", "run_started", resumed_from="snap", snapshot_id=1, cut_time=2.25),
    ]
    (stop,) = analyze(events).stops
    assert stop.in_flight_at_stop == 1
    assert stop.since_cut_s == pytest.approx(0.25)


def test_the_summary_line_names_all_the_work_a_kill_lost_not_only_the_cut_s_share() -> None:
    """``rolloutrun chaos examples/tiny-multiturn.yaml --kills 4 --seed 13`` printed
    ``thrown away [0.0, 0.0, 0.0, 0.0] s``: its incarnations resumed from nothing or from a
    trainer checkpoint, which lose everything after the cut (121.7 s in the first kill)."""
    data = {"rollout_work_lost_s": [121.70065, 13.604925, 0.0], "thrown_away_s": [0.0, 0.0, 0.0]}
    assert lost_words(data) == (
        "rollout work lost per kill [121.7, 13.6, 0.0] s "
        "(thrown away at the restored cut [0.0, 0.0, 0.0] s)"
    )

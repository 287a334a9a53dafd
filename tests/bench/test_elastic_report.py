"""bench/elastic.py's Gym arms: what each deletion's report says, and the verdict over seeds
(pure; never a timing). Before, a deletion whose replacement had not reached every stage was
left out of the report and of the time goal, so a replacement that never worked could not
fail it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.elastic import _document, over_seeds, runtime_at
from bench.elastic_report import (
    STAGES,
    ReplacementWatch,
    _breakdown_stats,
    cpu_around_deletions,
    deletion_report,
    dispatch_times,
    gym_start_figures,
    pod_cpu_rows,
    rollouts_around_deletions,
    standby_work,
    steps_around_deletions,
    trace_times,
)
from bench.gym_startup import CONFIG
from bench.pod_cpu import MACHINE, THIS_PROCESS
from rolloutrun_localcluster.embedded import LOGS_DIR
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter, read_events
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN, gym_pod_name, trainer_pod_name

AT = 1000.0
#: Moments of one replacement, from the deletion at ``AT``, as the API polls and logs give.
FULL = {
    "old_gym_stopping": AT + 0.05,
    "old_pod_gone": AT + 0.4,
    "trainer_noticed": AT + 0.1,
    "new_pod_created": AT + 0.5,
    "trainer_readdressed": AT + 0.7,
    "pod_running": AT + 0.6,
    "gym_listening": AT + 2.0,
    "trainer_readmitted": AT + 2.2,
    "first_run": AT + 2.3,
}


def test_a_replacement_doing_work_has_every_stage_from_the_one_before_and_its_total() -> None:
    report = deletion_report(AT, "bench-i1-gym-0", FULL, window_end=AT + 20)
    assert report["outcome"] == "doing work"
    assert report["reached"] == "first_run"
    assert [key for key, _ in STAGES if key in report] == [key for key, _ in STAGES]
    assert report["gym_listening"] == pytest.approx(1.4)
    assert report["total"] == pytest.approx(2.3)
    assert report["trainer_noticed_after_s"] == pytest.approx(0.1)
    assert report["old_gym_stopping_after_s"] == pytest.approx(0.05)


def test_a_replacement_that_never_worked_is_reported_where_it_stopped() -> None:
    times = {k: v for k, v in FULL.items() if k not in ("trainer_readmitted", "first_run")}
    report = deletion_report(AT, "bench-i1-gym-1", times, window_end=AT + 20)
    assert report["outcome"] == "no work within the goal"
    assert report["reached"] == "gym_listening"
    assert "total" not in report


def test_a_deletion_the_window_ended_on_is_neither_a_hit_nor_a_miss() -> None:
    times = {"old_pod_gone": AT + 0.4}
    report = deletion_report(AT, "bench-i1-gym-0", times, window_end=AT + 3)
    assert (report["outcome"], report["reached"]) == ("window ended first", "old_pod_gone")
    nothing = deletion_report(AT, "bench-i1-gym-0", {}, window_end=AT + 1)
    assert nothing["reached"] == "deleted"


def _seed(seed: int, ratio: float, first_run_max: float, missed: int) -> dict[str, Any]:
    outcomes = {"doing work": 2, "no work within the goal": missed, "window ended first": 0}
    return {
        "seed": seed,
        "elastic_vs_undisturbed": ratio,
        "elastic": {"loss_to_first_run_s": {"n": 2, "max": first_run_max}, "outcomes": outcomes},
    }


def test_a_replacement_that_never_worked_fails_the_time_goal() -> None:
    verdict = over_seeds([_seed(0, 0.97, 2.5, 0), _seed(1, 0.95, 3.0, 1)])
    assert verdict["deletions_without_work_within_goal"] == 1
    assert verdict["worst_seed_replacement"] == 1
    assert verdict["goals_on_worst_seed"] == {
        "rate >= 0.90 of undisturbed": True,
        "loss -> first work <= 5 s (max)": False,
    }


def test_the_before_arm_has_its_own_verdict() -> None:
    seeds = [
        {**_seed(0, 0.97, 2.5, 0), "elastic_before_vs_undisturbed": 0.85,
         "elastic_before": _seed(0, 0, 6.0, 0)["elastic"]},
    ]  # fmt: skip
    before = over_seeds(seeds, "elastic_before")
    assert before["goals_on_worst_seed"] == {
        "rate >= 0.90 of undisturbed": False,
        "loss -> first work <= 5 s (max)": False,
    }
    assert all(over_seeds(seeds)["goals_on_worst_seed"].values())


def test_over_seeds_break_every_deletion_of_every_seed_down_by_stage() -> None:
    seeds = [_seed(0, 0.97, 2.3, 0), _seed(1, 0.95, 4.3, 0)]
    slow = {**FULL, **{k: v + 2.0 for k, v in FULL.items() if k != "old_pod_gone"}}
    for seed, times in zip(seeds, (FULL, slow), strict=True):
        seed["elastic"]["per_deletion"] = [deletion_report(AT, "bench-i1-gym-0", times, AT + 20)]
    breakdown = over_seeds(seeds)["breakdown_s (every deletion of every seed)"]
    assert breakdown["new_pod_created"] == {"n": 2, "p50": 1.1, "max": 2.1}  # 0.1 and 2.1 s
    assert breakdown["gym_listening"]["max"] == pytest.approx(1.4)
    assert breakdown["total"]["max"] == pytest.approx(4.3)


def test_a_gyms_listening_line_gives_its_start_up_figures(tmp_path: Path) -> None:
    """The real Gym's line, read as the bench reads it (an older Gym's line has none)."""
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    gym = subprocess.Popen(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "gym", "--config", str(config),
         "--port", "0", "--instance-id", "g"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, ENV_GYM_TOKEN: "token"},
    )  # fmt: skip
    try:
        assert gym.stderr is not None
        line = next((text for text in gym.stderr if "listening on" in text), "")
    finally:
        gym.terminate()
        gym.wait(timeout=60)
    figures = gym_start_figures(line)
    assert set(figures) == {"gym_start_cpu_s", "gym_start_wall_s"}, line
    assert figures["gym_start_cpu_s"] > 0 and figures["gym_start_wall_s"] > 0
    older = "2026-01-01 00:00:00,000 INFO x: gym g listening on http://127.0.0.1:1"
    assert gym_start_figures(older) == {}
    assert "gym_start_cpu_s" in _breakdown_stats([figures])


def _pod(uid: str, phase: str = "Pending", ip: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        metadata=SimpleNamespace(uid=uid), status=SimpleNamespace(phase=phase, pod_ip=ip)
    )


def test_a_replacement_watch_takes_each_moment_from_the_first_event_that_shows_it() -> None:
    watch = ReplacementWatch(None, "bench-i1-gym-0", "old", AT)  # type: ignore[arg-type]
    watch.seen(_pod("old"), AT + 0.1)  # terminating: still the old pod
    assert watch.times == {}
    watch.seen(_pod("old"), AT + 0.4, deleted=True)
    watch.seen(_pod("new"), AT + 0.5)
    watch.seen(_pod("new", "Running"), AT + 0.6)  # no address yet
    watch.seen(_pod("new", "Running", "10.0.0.9"), AT + 0.8)
    watch.seen(_pod("new", "Running", "10.0.0.9"), AT + 0.9)
    assert watch.times == {
        "old_pod_gone": AT + 0.4, "new_pod_created": AT + 0.5, "pod_running": AT + 0.8,
    }  # fmt: skip
    assert watch.new_uid == "new"
    direct = ReplacementWatch(None, "bench-i1-gym-0", "old", AT)  # type: ignore[arg-type]
    direct.seen(_pod("new", "Running", "10.0.0.9"), AT + 1.0)  # the deletion's events missed
    assert set(direct.times) == {"old_pod_gone", "new_pod_created", "pod_running"}


def test_a_baseline_directory_that_is_not_a_checkout_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a rolloutrun checkout"):
        runtime_at(str(tmp_path), tmp_path / "copy")


def test_steps_around_a_deletion_count_both_arms_over_the_same_moments() -> None:
    elastic = [99.0, 101.0, 103.5, 108.0]  # fewer steps right after the deletion at 100
    undisturbed = [96.0, 99.5, 100.5, 101.5, 102.5, 104.0, 105.9, 106.0]
    found = steps_around_deletions([100.0], elastic, undisturbed, window_s=6.0)
    assert found["per_deletion"] == [
        {"after": {"elastic": 2, "undisturbed": 5}, "before": {"elastic": 1, "undisturbed": 2}}
    ]
    assert found["lost_after"] == 3 and found["lost_before"] == 1


def test_steps_around_deletions_add_up_over_the_deletions() -> None:
    steps = [float(t) for t in range(0, 40)]
    found = steps_around_deletions([15.0, 30.0], steps[::2], steps, window_s=6.0)
    assert [d["after"] for d in found["per_deletion"]] == [
        {"elastic": 3, "undisturbed": 6},
        {"elastic": 3, "undisturbed": 6},
    ]
    assert found["lost_after"] == 6 and found["lost_before"] == 6


def test_cpu_around_a_deletion_sums_each_role_of_both_arms_over_the_same_moments() -> None:
    # the elastic arm: its trainer starved after the deletion at 100 while a Gym started
    elastic = [[97.0, "trainer", 0.3], [99.0, "gym", 0.1], [101.0, "trainer", 0.1],
               [102.0, "gym", 0.45], [103.0, "gym", 0.05], [106.5, "trainer", 0.5]]  # fmt: skip
    undisturbed = [[97.5, "trainer", 0.3], [101.0, "trainer", 0.25], [104.0, "trainer", 0.25],
                   [102.0, "gym", 0.1]]  # fmt: skip
    found = cpu_around_deletions([100.0], elastic, undisturbed, window_s=6.0)
    assert found["per_deletion"] == [
        {
            "after": {
                "trainer": {"elastic": 0.1, "undisturbed": 0.5},
                "gym": {"elastic": 0.5, "undisturbed": 0.1},
            },
            "before": {
                "trainer": {"elastic": 0.3, "undisturbed": 0.3},
                "gym": {"elastic": 0.1, "undisturbed": 0.0},
            },
        }
    ]
    assert found["trainer_cpu_lost_after_s"] == 0.4
    assert found["gym_cpu_extra_after_s"] == 0.4
    assert found["trainer_cpu_lost_before_s"] == 0.0
    assert found["gym_cpu_extra_before_s"] == 0.1


def test_pod_cpu_rows_keep_the_trainer_and_gym_pods_by_their_names() -> None:
    names = {
        "u-trainer": trainer_pod_name("bench", 1),
        "u-gym": gym_pod_name("bench", 1, 0),
        "u-replacement": gym_pod_name("bench", 1, 0),  # a replacement keeps the old name
    }
    rows = [
        (10.0, "u-trainer", 0.12345),
        (10.0, "u-gym", 0.05),
        (10.25, "u-replacement", 0.2),
        (10.25, THIS_PROCESS, 0.3),  # the bench's own process and the machine: not pods
        (10.25, MACHINE, 0.9),
    ]
    assert pod_cpu_rows(rows, names) == [
        [10.0, "trainer", 0.1235],
        [10.0, "gym", 0.05],
        [10.25, "gym", 0.2],
    ]


def test_trace_times_read_what_the_trainer_traced_and_skip_a_torn_line(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / LOGS_DIR / TRACE_FILE)  # as an arm's trainer writes it
    writer.emit("attempt_sealed", group_id="g", generation_index=0)
    writer.emit("group_reserved", group_id="h")  # not counted
    writer.emit("group_dropped", group_id="g", reason="zero reward variance")
    writer.emit("attempt_sealed", group_id="g", generation_index=1)
    writer.close()
    written = list(read_events(tmp_path / LOGS_DIR / TRACE_FILE))
    with (tmp_path / LOGS_DIR / TRACE_FILE).open("a") as trace:
        trace.write('{"t": 5.0, "event": "attempt_se')  # a write cut by the arm's end
    times = trace_times(tmp_path)
    assert times == {
        "attempt_sealed": [written[0]["t"], written[3]["t"]],
        "group_dropped": [written[2]["t"]],
    }
    assert trace_times(tmp_path / "no-such-arm") == {"attempt_sealed": [], "group_dropped": []}


def test_rollouts_around_deletions_tell_fewer_rollouts_from_more_dropped_groups() -> None:
    elastic = {"attempt_sealed": [95.0, 96.0, 101.0, 102.0], "group_dropped": [101.5, 103.0]}
    undisturbed = {"attempt_sealed": [95.5, 96.5, 97.0, 100.5, 101.0, 102.0, 104.0],
                   "group_dropped": [99.0]}  # fmt: skip
    found = rollouts_around_deletions([100.0], elastic, undisturbed, window_s=6.0)
    assert found["per_deletion"] == [
        {
            "after": {
                "attempt_sealed": {"elastic": 2, "undisturbed": 4},
                "group_dropped": {"elastic": 2, "undisturbed": 0},
            },
            "before": {
                "attempt_sealed": {"elastic": 2, "undisturbed": 3},
                "group_dropped": {"elastic": 0, "undisturbed": 1},
            },
        }
    ]
    assert found["rollouts_lost_after"] == 2 and found["rollouts_lost_before"] == 1
    assert found["groups_dropped_extra_after"] == 2
    assert found["groups_dropped_extra_before"] == -1


def test_dispatch_times_read_each_attempts_gym_from_the_trace(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / LOGS_DIR / TRACE_FILE)  # as an arm's trainer writes it
    writer.emit("attempt_dispatched", group_id="g", gym_instance_id="bench-gym-0")
    writer.emit("attempt_sealed", group_id="g", generation_index=0)  # not a dispatch
    writer.emit("attempt_dispatched", group_id="g", gym_instance_id="bench-gym-2")
    writer.close()
    written = list(read_events(tmp_path / LOGS_DIR / TRACE_FILE))
    with (tmp_path / LOGS_DIR / TRACE_FILE).open("a") as trace:
        trace.write('{"t": 5.0, "event": "attempt_dis')  # a write cut by the arm's end
    assert dispatch_times(tmp_path) == [
        (written[0]["t"], "bench-gym-0"),
        (written[2]["t"], "bench-gym-2"),
    ]
    assert dispatch_times(tmp_path / "no-such-arm") == []


def test_standby_work_says_when_the_standby_was_handed_work_after_each_loss() -> None:
    dispatches = [(1.0, "gym-0"), (2.0, "gym-1"), (10.5, "gym-2"), (11.0, "gym-2"),
                  (26.0, "gym-2"), (3.0, "gym-1")]  # fmt: skip
    work = standby_work(dispatches, {"gym-2"}, [10.0, 25.0, 40.0])
    assert work == {
        "dispatches_to_standby": 3,
        "before_first_loss": 0,
        "loss_to_first_standby_dispatch_s": [0.5, 1.0, None],
    }
    early = standby_work([(5.0, "gym-2")], {"gym-2"}, [10.0])  # work before any loss
    assert early["before_first_loss"] == 1
    assert early["loss_to_first_standby_dispatch_s"] == [None]
    assert standby_work(dispatches, {"gym-2"}, [])["before_first_loss"] == 3
    # the arm's teardown (after its window) stops every Gym: not counted
    ended = standby_work([*dispatches, (50.0, "gym-2")], {"gym-2"}, [10.0, 25.0], until=30.0)
    assert ended["dispatches_to_standby"] == 3
    assert ended["loss_to_first_standby_dispatch_s"] == [0.5, 1.0]


def test_every_arm_gets_the_gym_standby_asked_for() -> None:
    assert _document(True, 0, "turn", gym_standby=1)["spec"]["gym"]["standby"] == 1
    assert _document(False, 1)["spec"]["gym"]["standby"] == 0

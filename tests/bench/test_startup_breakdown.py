"""bench/startup_breakdown.py: how a trainer's start-up marks become phases, and which
imports the report names (pure functions; never a timing)."""

from __future__ import annotations

from bench.startup_breakdown import STEPS, kill_moments, segments, summarize, top_level_imports


def test_segments_are_named_by_the_mark_that_ends_them_and_sum_to_the_total() -> None:
    marks = {
        "process_started": [100.02, 0.0],
        "command_loaded": [100.1, 0.07],
        "torch_imported": [101.7, 1.6],
        "relaunched": [102.0, 1.9],
    }
    phases = segments(marks, launch=100.0, first=102.05)
    assert list(phases["wall_s"]) == [
        "spawn",
        "command_loaded",
        "torch_imported",
        "relaunched",
        "first_dispatch",
    ]
    assert round(sum(phases["wall_s"].values()), 6) == 2.05
    assert phases["cpu_s"] == {"command_loaded": 0.07, "torch_imported": 1.53, "relaunched": 0.3}


def test_the_report_names_imports_made_outside_any_other_import() -> None:
    text = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:      5000 |      90000 |   torch._dynamo.utils",
            "import time:       700 |    2137139 | torch._dynamo",
            "import time:       100 |      30000 | yaml",
            "some log line",
        ]
    )
    assert top_level_imports(text) == {"torch._dynamo": 2.137, "yaml": 0.03}


def test_every_kill_is_past_a_step_and_inside_the_run() -> None:
    for kills in (1, 2, 3):
        moments = kill_moments(kills)
        assert len(moments) == kills and moments == sorted(moments)
        assert all(1 < m < STEPS and m % 1 > 0 for m in moments)


def test_summary_reports_p50_and_worst_and_phases_only_where_marked() -> None:
    samples = [
        {"launch_to_first_dispatch_s": 3.0, "cpu_to_first_dispatch_s": 2.0},
        {
            "launch_to_first_dispatch_s": 1.0,
            "cpu_to_first_dispatch_s": 1.5,
            "phases": {"wall_s": {"spawn": 0.01}, "cpu_s": {"command_loaded": 0.1}},
        },
    ]
    report = summarize(samples)
    assert report["launch_to_first_dispatch_s"] == {"p50": 2.0, "worst": 3.0, "n": 2}
    assert report["phases_wall_s"] == {"spawn": {"p50": 0.01, "worst": 0.01, "n": 1}}


def test_summary_reports_the_run_queue_time_where_sampled() -> None:
    """How long the trainer was runnable without a core (schedstat), beside wall and CPU."""
    samples = [
        {"launch_to_first_dispatch_s": 3.0, "cpu_to_first_dispatch_s": 1.8},
        {
            "launch_to_first_dispatch_s": 2.2,
            "cpu_to_first_dispatch_s": 1.7,
            "runqueue_to_first_dispatch_s": 0.4,
        },
    ]
    report = summarize(samples)
    assert report["runqueue_to_first_dispatch_s"] == {"p50": 0.4, "worst": 0.4, "n": 1}


def test_the_run_queue_time_of_a_live_process_is_read_and_of_a_gone_one_is_zero() -> None:
    import os

    from bench.startup_breakdown import _queued

    assert _queued(os.getpid()) >= 0.0
    assert _queued(2**22 + 1) == 0.0  # above pid_max: no such process


def test_a_trainers_lease_keeper_is_found_among_its_children() -> None:
    import os
    import subprocess
    import sys

    from bench.startup_breakdown import _keeper_of
    from rolloutrun_localcluster.testing import eventually

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    keeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "rolloutrun_runtime.lease_keeper"]
    )
    try:
        # (its command line is in /proc only once its exec is through: the watcher polls)
        eventually(lambda: _keeper_of(os.getpid()) == keeper.pid, timeout=30, what="keeper")
        keeper.kill()
        keeper.wait()
        assert _keeper_of(os.getpid()) is None
    finally:
        for process in (other, keeper):
            process.kill()
            process.wait()

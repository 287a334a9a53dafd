"""bench/rollout_throughput.py: the window after warm-up, the pairs and their spread (pure;
the interleaved runs themselves are the bench's, never timed here)."""

from __future__ import annotations

import pytest

from bench.rollout_throughput import pair, spread, summarize, verdict, window


def _samples(step_s: float, cpu_per_step: float, steps: int, first_s: float = 5.0):
    """A run whose first step took ``first_s`` (start-up) and every later one ``step_s``."""
    t = cpu = 0.0
    out = []
    for step in range(steps):
        t += first_s if step == 0 else step_s
        cpu += 3.0 if step == 0 else cpu_per_step
        out.append({"t": t, "cpu": cpu, "cpu_sys": cpu / 10, "gym_cpu": cpu / 4, "tokens": 100})
    return out


def test_the_window_counts_the_same_steps_after_warm_up_and_leaves_start_up_out() -> None:
    got = window(_samples(0.5, 0.2, 24), warmup=4)
    assert got["steps"] == 20
    assert got["steps_per_s"] == pytest.approx(2.0) and got["median_step_s"] == pytest.approx(0.5)
    assert got["tokens_per_s"] == pytest.approx(200.0)
    assert got["cpu_ms_per_step"] == pytest.approx(200.0)
    assert got["cpu_sys_ms_per_step"] == pytest.approx(20.0)
    assert got["gym_cpu_ms_per_step"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="warm-up"):
        window(_samples(0.5, 0.2, 4), warmup=4)
    with pytest.raises(ValueError, match="warm-up"):
        window(_samples(0.5, 0.2, 8), warmup=0)


def test_pairs_give_the_throughput_and_cpu_ratios_and_the_summary_their_spread() -> None:
    off = window(_samples(0.5, 0.2, 24), 4)
    reps = [
        pair(window(_samples(step_s, 0.25, 24), 4), off, ["on", "off"])
        for step_s in (0.5, 0.51, 0.52, 0.55, 0.5)
    ]
    assert reps[0]["ratio"] == pytest.approx(1.0) and reps[3]["ratio"] == pytest.approx(0.9091)
    assert reps[0]["cpu_ratio"] == pytest.approx(0.8)  # (200 + 50) / (250 + 62.5)
    summary = summarize(reps)
    assert summary["ratio"]["median"] == pytest.approx(0.9804, abs=1e-4)  # 0.5 / 0.51
    assert summary["ratio"]["min"] == pytest.approx(0.9091) and summary["ratio"]["max"] == 1.0
    assert summary["snapshot_cpu_ms_per_step"]["median"] == pytest.approx(62.5)
    assert summary["ratio"]["q3"] == 1.0
    assert summary["met"] is None  # the median misses 0.995, the upper quartile does not
    assert spread([1.0])["q1"] == spread([1.0])["q3"] == 1.0


def test_a_spread_that_straddles_the_goal_decides_nothing() -> None:
    assert verdict({"q1": 0.996, "median": 0.999, "q3": 1.002}) is True
    assert verdict({"q1": 0.98, "median": 1.05, "q3": 1.12}) is None
    assert verdict({"q1": 0.97, "median": 0.98, "q3": 0.99}) is False


def test_thread_cpu_is_counted_per_kind_of_thread() -> None:
    """The per-thread split reads this process's threads by their Python names, numbers
    left out, so a pool's threads add up under one kind."""
    import threading
    import time

    from bench.rollout_throughput import thread_cpu_s

    done, release = threading.Barrier(3), threading.Event()

    def burn() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.wait(timeout=5)
        release.wait(timeout=5)

    before = thread_cpu_s()
    workers = [threading.Thread(target=burn, name=f"burner_{i}") for i in range(2)]
    for w in workers:
        w.start()
    done.wait(timeout=5)
    try:
        after = thread_cpu_s()
    finally:
        release.set()
        for w in workers:
            w.join(timeout=5)
    assert "burner" not in before and after["burner"] >= 0.07  # both (one is <= 0.06 in ticks)
    assert "MainThread" in after

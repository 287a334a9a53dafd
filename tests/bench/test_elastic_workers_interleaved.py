"""bench/elastic_workers_interleaved.py: a seed's U/D segments to the worker verdict (pure)."""

from __future__ import annotations

from bench.elastic_workers import worker_over_seeds
from bench.elastic_workers_interleaved import seed_result


def _replaced(readmitted_max: float) -> dict:
    return {"loss_to_readmitted_s": {"n": 2, "p50": 0.1, "max": readmitted_max}}


def test_the_seeds_ratio_is_the_disturbed_segments_rate_over_the_undisturbed_ones() -> None:
    # U D D U: 300 and 260 steps in 30 s undisturbed, 250 in 36 s and 240 in 34 s disturbed
    # (a D segment runs on until its refills are ready)
    segments = [("U", 300, 30.0), ("D", 250, 36.0), ("D", 240, 34.0), ("U", 260, 30.0)]
    result = seed_result(2, segments, _replaced(0.2), incarnations=1)
    assert result["undisturbed"]["steps_per_min"] == 560.0
    assert result["disturbed_steps_per_min"] == 420.0
    assert result["standby_vs_undisturbed"] == result["elastic_vs_undisturbed"] == 0.75
    assert result["per_pair_ratio"] == [round((250 / 36) / (300 / 30), 3),
                                        round((240 / 34) / (260 / 30), 3)]  # fmt: skip


def test_its_seeds_get_the_worker_verdict_on_the_worst_seed() -> None:
    good = seed_result(0, [("U", 300, 30.0), ("D", 290, 30.0)], _replaced(0.1), 1)
    worst = seed_result(1, [("U", 300, 30.0), ("D", 240, 30.0)], _replaced(0.3), 1)
    verdict = worker_over_seeds([good, worst])["standby"]
    assert verdict["worst_seed_rate"] == 1
    assert verdict["goals_on_worst_seed"] == {
        "rate >= 0.90 of undisturbed": False,
        "loss -> replacement doing work <= 5 s (max)": True,
    }


def test_segments_come_in_abba_order() -> None:
    from bench.elastic_report import abba_pairs

    assert abba_pairs(3) == [("U", "D"), ("D", "U"), ("U", "D")]

"""bench/elastic_workers.py: the worker arms' verdict over seeds (pure; never a timing)."""

from __future__ import annotations

from typing import Any

from bench.elastic_workers import worker_over_seeds


def _seed(seed: int, ratio: float, readmitted_max: float | None, missing: int) -> dict[str, Any]:
    stats = {"n": 0} if readmitted_max is None else {"n": 2, "p50": 1.0, "max": readmitted_max}
    return {
        "seed": seed,
        "elastic_vs_undisturbed": ratio,
        "elastic": {"loss_to_readmitted_s": stats, "not_readmitted": missing},
    }


def test_goals_are_checked_on_the_worst_seed() -> None:
    verdict = worker_over_seeds([_seed(0, 0.97, 3.1, 0), _seed(1, 0.88, 4.2, 0)])
    assert (verdict["worst_seed_rate"], verdict["worst_seed_replacement"]) == (1, 1)
    assert verdict["goals_on_worst_seed"] == {
        "rate >= 0.90 of undisturbed": False,
        "loss -> replacement doing work <= 5 s (max)": True,
    }


def test_a_replacement_that_never_got_to_work_fails_the_time_goal() -> None:
    verdict = worker_over_seeds([_seed(0, 0.95, 2.0, 0), _seed(1, 0.96, None, 1)])
    assert verdict["deletions_never_readmitted"] == 1
    assert verdict["goals_on_worst_seed"]["loss -> replacement doing work <= 5 s (max)"] is False
    assert verdict["goals_on_worst_seed"]["rate >= 0.90 of undisturbed"] is True

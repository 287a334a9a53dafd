"""bench/elastic_workers.py: the worker arms' verdict over seeds (pure; never a timing)."""

from __future__ import annotations

from typing import Any

from bench.elastic_workers import serving_urls, worker_over_seeds


def _seed(seed: int, ratio: float, readmitted_max: float | None, missing: int) -> dict[str, Any]:
    stats = {"n": 0} if readmitted_max is None else {"n": 2, "p50": 1.0, "max": readmitted_max}
    return {
        "seed": seed,
        "elastic_vs_undisturbed": ratio,
        "elastic": {"loss_to_readmitted_s": stats, "not_readmitted": missing},
    }


def test_goals_are_checked_on_the_worst_seed() -> None:
    verdict = worker_over_seeds([_seed(0, 0.97, 3.1, 0), _seed(1, 0.88, 4.2, 0)])["elastic"]
    assert (verdict["worst_seed_rate"], verdict["worst_seed_replacement"]) == (1, 1)
    assert verdict["goals_on_worst_seed"] == {
        "rate >= 0.90 of undisturbed": False,
        "loss -> replacement doing work <= 5 s (max)": True,
    }


def test_a_replacement_that_never_got_to_work_fails_the_time_goal() -> None:
    verdict = worker_over_seeds([_seed(0, 0.95, 2.0, 0), _seed(1, 0.96, None, 1)])["elastic"]
    assert verdict["deletions_never_readmitted"] == 1
    assert verdict["goals_on_worst_seed"]["loss -> replacement doing work <= 5 s (max)"] is False
    assert verdict["goals_on_worst_seed"]["rate >= 0.90 of undisturbed"] is True


def test_the_standby_arm_has_its_own_verdict() -> None:
    seeds = [
        {
            **_seed(0, 0.80, 9.0, 0),
            "standby_vs_undisturbed": 0.95,
            "standby": _seed(0, 0, 1.5, 0)["elastic"],
        },
        {
            **_seed(1, 0.85, 8.0, 0),
            "standby_vs_undisturbed": 0.93,
            "standby": _seed(1, 0, 2.5, 0)["elastic"],
        },
    ]
    verdict = worker_over_seeds(seeds)
    assert verdict["elastic"]["goals_on_worst_seed"]["rate >= 0.90 of undisturbed"] is False
    assert verdict["standby"]["worst_seed_rate"] == 1
    assert all(verdict["standby"]["goals_on_worst_seed"].values())


def test_serving_urls_follow_placements_and_readmissions() -> None:
    lines = [
        "x INFO Ray generation workers at ['http://10.0.0.3:8001', 'http://10.0.0.4:8001'] "
        "placed [{'url': 'http://10.0.0.3:8001'}]",
        "x INFO generation worker 1 re-admitted at version 7 at http://10.0.0.5:8001",
        "x INFO generation worker 0 re-admitted at version 9",  # an older trainer's line
    ]
    assert serving_urls(lines) == {0: "http://10.0.0.3:8001", 1: "http://10.0.0.5:8001"}

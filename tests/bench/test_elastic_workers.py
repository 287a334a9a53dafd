"""bench/elastic_workers.py: the worker arms' verdict over seeds (pure; never a timing)."""

from __future__ import annotations

from typing import Any

from bench.elastic_workers import (
    WORKER_ARM_RESOURCES,
    _outcome,
    _worker_document,
    serving_urls,
    standby_urls,
    worker_over_seeds,
)


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


def test_a_lost_index_serves_nowhere_until_its_readmission() -> None:
    lines = [
        "x INFO Ray generation workers at ['http://10.0.0.3:8001', 'http://10.0.0.4:8001'] "
        "placed [{'url': 'http://10.0.0.3:8001'}]",
        "x WARNING generation worker 0 lost (The actor died): replacing it (1)",
    ]
    assert serving_urls(lines) == {1: "http://10.0.0.4:8001"}  # before: 0 still "served"


def test_the_standby_pool_is_read_from_the_trainers_log() -> None:
    lines = [
        "x INFO standby generation worker started at http://10.0.0.5:8001 (1 in the pool)",
        "x INFO standby generation worker started at http://10.0.0.6:8001 (2 in the pool)",
        "x INFO generation worker 0: standby at http://10.0.0.5:8001 admitted",
    ]
    assert standby_urls(lines) == {"http://10.0.0.6:8001"}


#: A trainer's log after an active worker 1 was deleted at t = 100 (epoch seconds).
LOG = [
    (99.0, "generation worker 0 re-admitted at version 3 at http://a:1"),  # an earlier one
    (100.4, "generation worker 1 lost (The actor died): replacing it (1)"),
    (100.4, "generation worker 1: standby at http://c:1 admitted"),
    (101.1, "generation worker 1 re-admitted at version 4 at http://c:1"),
    (112.0, "standby generation worker started at http://d:1 (1 in the pool)"),
]
ACTIVE = {"pod": "bench-i1-worker-1", "kind": "active", "index": 1}


def test_a_deletion_of_an_active_pod_reports_its_loss_and_the_standby_doing_work() -> None:
    out = _outcome(LOG, 100.0, ACTIVE, 60)
    assert out == {"detected_after_s": 100.4, "doing_work_after_s": 101.1, "via": "standby"}


def test_a_deletion_never_readmitted_says_why() -> None:
    lost_only = LOG[:2]
    out = _outcome(lost_only, 100.0, ACTIVE, 60)
    assert out["doing_work_after_s"] is None
    assert out["not_readmitted"].startswith("no started standby at the loss")
    silent = _outcome(LOG[:1], 100.0, ACTIVE, 60)
    assert silent == {"not_readmitted": "the trainer reported no loss of worker 1 within 60 s"}


def test_a_standby_pods_deletion_is_counted_by_its_refill_ready() -> None:
    log = [
        (100.3, "standby generation worker lost (The actor died): starting another"),
        (111.0, "standby generation worker started at http://e:1 (1 in the pool)"),
    ]
    standby = {"pod": "bench-i1-worker-2", "kind": "standby", "index": None}
    assert _outcome(log, 100.0, standby, 60) == {
        "detected_after_s": 100.3,
        "refill_ready_after_s": 111.0,
    }
    assert "not_refilled" in _outcome(log[:1], 100.0, standby, 60)


def test_a_loss_taken_by_a_standby_that_started_later_says_it_waited_for_the_refill() -> None:
    log = [
        (100.1, "generation worker 0 lost (The actor died): replacing it (1)"),
        (121.0, "standby generation worker started at http://f:1 (1 in the pool)"),
        (121.0, "generation worker 0: standby at http://f:1 admitted"),
        (121.1, "generation worker 0 re-admitted at version 9 at http://f:1"),
    ]
    active = {"pod": "bench-i1-worker-0", "kind": "active", "index": 0}
    assert _outcome(log, 100.0, active, 60)["via"] == "refill standby"


def test_every_worker_arm_asks_for_the_same_resources_per_pod() -> None:
    """The undisturbed and disturbed arms run the same pods (fair rates), and each member
    asks for CPU the local cluster enforces (a refill worker pod cannot take the trainer's
    share), the trainer's request the largest."""
    undisturbed, disturbed = _worker_document(True, 0, 1), _worker_document(True, 0, 1)
    for member in ("trainer", "gym", "workers"):
        assert undisturbed["spec"][member]["resources"] == WORKER_ARM_RESOURCES[member]
        assert disturbed["spec"][member]["resources"] == WORKER_ARM_RESOURCES[member]
    requests = {m: r["requests"]["cpu"] for m, r in WORKER_ARM_RESOURCES.items()}
    assert requests["trainer"] == "1" and "limits" in WORKER_ARM_RESOURCES["workers"]

"""The API load benchmark's measurement of a replacement: phases read off the API server's
commits, and a sample only once every mark of it was committed."""

from __future__ import annotations

from bench.operator_scale import phases


def test_a_replacement_is_split_into_the_operators_passes_and_the_kubelets_part():
    at = {
        ("deleted", "r-i1-trainer"): 10.1,
        ("deleting", "r-i1-gym-0"): 10.3,
        ("deleting", "r-i1-gym-1"): 10.4,
        ("deleted", "r-i1-gym-0"): 10.6,
        ("deleted", "r-i1-gym-1"): 10.5,
        ("added", "r-i2-gym-0"): 11.0,
    }
    assert phases(at, "r", 1, 10.0) == {
        "trainer_gone": 0.1,
        "gyms_deleting": 0.4,  # the later of the two: the operator's first pass done
        "gyms_gone": 0.6,
        "replacement": 1.0,
    }


def test_a_gym_deleted_without_a_grace_period_counts_as_marked_when_it_went():
    at = {
        ("deleted", "r-i3-trainer"): 5.0,
        ("deleted", "r-i3-gym-0"): 5.5,  # never seen terminating
        ("deleting", "r-i3-gym-1"): 5.2,
        ("deleted", "r-i3-gym-1"): 5.4,
    }
    assert phases(at, "r", 3, 5.0) == {
        "trainer_gone": 0.0,
        "gyms_deleting": 0.5,
        "gyms_gone": 0.5,
    }  # no replacement committed yet: no such mark


def test_each_hollow_trainer_anchors_once_a_minute_at_its_own_phase(monkeypatch):
    from bench import hollow_load

    monkeypatch.delenv("BENCH_ANCHOR_BURST", raising=False)
    renewals = [1_800_000_000 + 5.0 * k for k in range(12 * 3)]  # every 5 s for 3 minutes

    def anchored(run: str) -> list[float]:
        return [t for t in renewals if hollow_load.anchor_due(run, t)]

    runs = [f"r{index:04d}" for index in range(50)]
    assert all(len(anchored(run)) == 3 for run in runs)  # once a minute each
    phases = {anchored(run)[0] % 60 for run in runs}
    assert len(phases) > 5  # spread over the minute, not one burst
    monkeypatch.setenv("BENCH_ANCHOR_BURST", "1")
    assert {anchored(run)[0] % 60 for run in runs} == {0.0}  # the earlier generator's burst


def test_the_replacement_is_reported_with_p90_beside_p50_p99_and_max():
    from bench.operator_scale import spread

    found = spread([float(k) for k in range(1, 101)])
    assert (found["n"], found["p90"], found["p99"], found["max"]) == (100, 91.0, 100.0, 100.0)

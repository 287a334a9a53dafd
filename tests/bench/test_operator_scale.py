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

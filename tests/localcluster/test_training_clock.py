"""``rolloutrun run --preempt-while-training``: when the current incarnation counts as training."""

from __future__ import annotations

from rolloutrun_localcluster.embedded import TrainingClock


def test_an_incarnation_trains_once_its_trainer_moved_the_step_it_first_wrote() -> None:
    clock = TrainingClock()
    assert clock.observe(None, None) is False  # no trainer of this incarnation holds the Lease
    assert clock.observe("run-i1-trainer/1", None) is False  # took the Lease, no step yet
    assert clock.observe("run-i1-trainer/1", "0") is True  # trained its first step


def test_a_new_holder_starts_over_from_the_step_left_on_the_lease() -> None:
    clock = TrainingClock()
    clock.observe("run-i1-trainer/1", "3")
    assert clock.observe("run-i1-trainer/1", "7") is True
    # The next incarnation finds the old step on the Lease: not training until it moves.
    assert clock.observe("run-i2-trainer/2", "7") is False
    assert clock.observe("run-i2-trainer/2", "7") is False
    assert clock.observe("run-i2-trainer/2", "8") is True
    # Lost the Lease (another incarnation's trainer, filtered to None): not training.
    assert clock.observe(None, "8") is False

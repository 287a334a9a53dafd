"""The local cluster's background pass loops keep to their share of the event loop: a pass
of t seconds makes the next one wait t * (1/share - 1), so passes over every object (the
collector, the scheduler) cannot starve the API server's requests during a burst of
events (at 1,000 runs a restart storm ran one full collector pass per event)."""

from __future__ import annotations

import inspect

from rolloutrun_localcluster import passes


def test_a_pass_is_followed_by_three_times_its_length_at_a_quarter_share():
    assert abs(passes.rest_after(0.4, 0.25) - 1.2) < 1e-9
    assert abs(passes.rest_after(0.1, 0.5) - 0.1) < 1e-9
    assert passes.rest_after(0.4, None) == 0.0
    assert passes.rest_after(0.0, 0.25) == 0.0


def test_every_pass_loop_keeps_to_a_quarter_unless_told():
    default = inspect.signature(passes.PassLoop).parameters["share"].default
    assert default == 0.25

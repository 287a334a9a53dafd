"""The ``IncarnationStarting`` Event says why an incarnation starts: a new run's first
says it was created, a resumed run's next says it was resumed (``kubectl describe rr``)."""

from __future__ import annotations

from rolloutrun_operator.reconcile import reconcile
from tests.support.rolloutruns import NOW, make_run, observed


def test_a_new_runs_first_incarnation_is_created_not_resumed():
    result = reconcile(make_run(), observed(), NOW)
    assert result.status.incarnation == 1
    assert [(e.reason, e.message) for e in result.events] == [
        ("IncarnationStarting", "incarnation 1 (Created)")
    ]


def test_a_suspended_run_set_going_again_is_resumed():
    suspended = {
        "incarnation": 1,
        "conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}],
    }
    result = reconcile(make_run(suspended), observed(), NOW)
    assert result.status.incarnation == 2
    assert [e.message for e in result.events] == ["incarnation 2 (Resumed)"]

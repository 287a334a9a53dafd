"""The trainer's step rate on the operator's clock, for ``status.stepRate``.

Why computed here and not by the trainer: the step is the Lease annotation every pass reads
anyway (no extra API call, no extra write by the trainer), and only the operator's own
clock can tell that a trainer whose Lease still renews has stopped making steps: a rate the
trainer published would stay at its last value. Pure, like :mod:`reconcile`.
"""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator.api.v1alpha1 import RolloutRunStatus
from rolloutrun_operator.observe import format_time, parse_time

#: The shortest window of operator time ``status.stepRate`` is measured over.
STEP_RATE_WINDOW_SECONDS = 60.0


def window_start(text: str | None) -> tuple[int, dt.datetime] | None:
    """``status.stepWindow`` (``<step>@<RFC 3339 time>``) read back, or None if unreadable."""
    step, _, time = (text or "").partition("@")
    when = parse_time(time)
    if not step.isdigit() or when is None:
        return None
    return int(step), when


def step_rate(status: RolloutRunStatus, training: bool, now: dt.datetime) -> None:
    """Update ``status.stepRate`` and its window's start (``status.stepWindow``) in place.

    Steps per minute: the train step now against the one seen at the window's start, once
    the window is :data:`STEP_RATE_WINDOW_SECONDS` long; a pass comes at least every idle
    requeue (30 s), so a stalled trainer reads 0 within two windows. A step lower than the
    window's (a restart resumed from an older checkpoint) starts a new window. Not
    ``training`` (not progressing, or no Lease yet): both cleared."""
    if not training:
        status.step_rate, status.step_window = None, None
        return
    start = window_start(status.step_window)
    here = f"{status.train_step}@{format_time(now)}"
    if start is None or start[1] > now or status.train_step < start[0]:
        status.step_window = here
        return
    elapsed = (now - start[1]).total_seconds()
    if elapsed >= STEP_RATE_WINDOW_SECONDS:
        status.step_rate = round((status.train_step - start[0]) * 60.0 / elapsed, 2)
        status.step_window = here

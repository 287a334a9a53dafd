"""The run's conditions: one desired value per type per pass, merged into the previous list.

Why its own module: Kubernetes conditions carry a ``lastTransitionTime`` that must change only
when the status flips, and every pass should state all six types (so ``kubectl get rr`` and
``kubectl wait --for=condition=...`` always find them). The reconcile says what each condition
is now; :func:`merge` keeps the transition times honest.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rolloutrun_operator.api.v1alpha1 import Condition, ConditionStatus
from rolloutrun_operator.observe import format_time


class ConditionType(enum.StrEnum):
    """The conditions a RolloutRun reports."""

    READY = "Ready"
    """Every member pod of the current incarnation runs."""
    PROGRESSING = "Progressing"
    """The run is starting or training (False once it stops for good or is suspended)."""
    RESTARTING = "Restarting"
    """An incarnation ended; the next one starts after the backoff."""
    SUSPENDED = "Suspended"
    """``spec.suspend`` stopped the run (its pods are gone once the reason is Suspended)."""
    SUCCEEDED = "Succeeded"
    """The trainer finished ``maxSteps`` and exited 0."""
    FAILED = "Failed"
    """Restarts after failures went past ``maxRestarts``."""


TERMINAL = (ConditionType.SUCCEEDED, ConditionType.FAILED)


@dataclass(frozen=True)
class Desired:
    """What one condition should say in this pass."""

    status: bool
    reason: str
    message: str = ""

    def __post_init__(self) -> None:
        # A condition without a reason tells ``kubectl get rr`` nothing (the CRD refuses one).
        if not self.reason:
            raise ValueError(f"a condition's reason must not be empty (message {self.message!r})")


def stopped(reason: str, message: str = "") -> dict[str, Desired]:
    """What a run that is not training says of Ready, Progressing and Restarting (keyword
    arguments of ``Pass.say``)."""
    return {
        "ready": Desired(False, reason, message),
        "progressing": Desired(False, reason, message),
        "restarting": Desired(False, reason),
    }


def ended(end: ConditionType, reason: str, message: str) -> dict[str, Desired]:
    """A run ended for good: ``end`` (Succeeded or Failed) True with ``reason``, the other
    False naming how it ended (a succeeded run's Failed must not still say Running), and the
    run stopped."""
    if end not in TERMINAL:
        raise ValueError(f"{end} is not how a run ends (one of {', '.join(TERMINAL)})")
    other = ConditionType.FAILED if end is ConditionType.SUCCEEDED else ConditionType.SUCCEEDED
    return {
        end.name.lower(): Desired(True, reason, message),
        other.name.lower(): Desired(False, str(end)),
        **stopped(str(end)),
    }


def change_after_end(
    conditions: Sequence[Condition], seen: int | None, generation: int | None
) -> str | None:
    """What to tell a user whose spec change (``generation``, the last pass saw ``seen``)
    reached a run that has ended, or None. An ended run starts nothing again (as a finished
    Job), so a raised ``maxSteps`` or a fixed storage would otherwise be ignored in silence;
    the way on is a new RolloutRun of the same name and storage, which resumes from them."""
    if seen is None or generation is None or generation == seen:
        return None
    end = next(
        (c for c in conditions if c.type in TERMINAL and c.status is ConditionStatus.TRUE), None
    )
    if end is None:
        return None
    return (
        f"the run has ended ({end.type}: {end.reason}), so this change of its spec (generation "
        f"{generation}) is not applied: an ended run starts no incarnation again. To train on "
        "from its storage, delete this RolloutRun and apply it again with the same name and "
        "storage: it resumes from the newest checkpoint there"
    )


def is_true(conditions: Sequence[Condition], kind: ConditionType) -> bool:
    return any(c.type == kind and c.status is ConditionStatus.TRUE for c in conditions)


def find(conditions: Sequence[Condition], kind: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type == kind), None)


def merge(
    previous: Sequence[Condition],
    desired: Mapping[ConditionType, Desired],
    now: dt.datetime,
    generation: int | None,
) -> list[Condition]:
    """All condition types in a fixed order; a transition time moves only when status flips."""
    merged = []
    for kind in ConditionType:
        old = find(previous, kind)
        want = desired.get(kind)
        if want is None:
            if old is not None:
                merged.append(old)
            continue
        status = ConditionStatus.TRUE if want.status else ConditionStatus.FALSE
        since = old.last_transition_time if old is not None and old.status is status else None
        merged.append(
            Condition(
                type=str(kind),
                status=status,
                reason=want.reason,
                message=want.message,
                last_transition_time=since or format_time(now),
                observed_generation=generation,
            )
        )
    return merged


def failure_patch(
    raw_status: Mapping[str, Any], reason: str, message: str, now: dt.datetime
) -> dict[str, Any] | None:
    """The status merge patch saying a pass failed (``Ready=False`` with ``reason`` and the
    API's ``message``; the other conditions kept), or None when the status says so already
    (so a failure repeated by the retries writes and announces nothing new)."""
    previous = []
    for item in raw_status.get("conditions") or []:
        try:
            previous.append(Condition.model_validate(item))
        except ValueError:
            continue
    old = find(previous, ConditionType.READY)
    if old is not None and (old.status, old.reason, old.message) == (
        ConditionStatus.FALSE,
        reason,
        message,
    ):
        return None
    generation = old.observed_generation if old is not None else None
    desired = {ConditionType.READY: Desired(False, reason, message)}
    merged = merge(previous, desired, now, generation)
    return {"conditions": [c.model_dump(mode="json", by_alias=True) for c in merged]}

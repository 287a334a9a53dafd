"""The RolloutRun's status: conditions, failures, the Lease as last seen, members and their
replacements.

Why a module of its own: the status is written only by the operator and read by users
(``kubectl get rr -o yaml``); the spec (``v1alpha1.py``) is what users write. Split so each
stays under 600 lines; the names are re-exported by ``v1alpha1``, where callers import them.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import Field
from pydantic.json_schema import JsonDict

from rolloutrun_operator.api.common import _Model

#: A time the operator writes (RFC 3339, as :func:`rolloutrun_operator.observe.format_time`).
_DATE_TIME: JsonDict = {"format": "date-time"}


class ConditionStatus(enum.StrEnum):
    """Kubernetes condition status."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Model):
    """One observation of the run's state (Ready, Progressing, Restarting, ...)."""

    type: str = Field(..., min_length=1, max_length=64, description="Condition type.")
    status: ConditionStatus = Field(..., description="True, False or Unknown.")
    reason: str = Field(
        ...,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason for the last transition (never empty).",
    )
    message: str = Field("", max_length=32_768, description="Human-readable details.")
    last_transition_time: str | None = Field(
        None,
        max_length=64,
        description="When the status last changed (RFC 3339).",
        json_schema_extra=_DATE_TIME,
    )
    observed_generation: int | None = Field(
        None, ge=0, le=2**53, description="The spec generation this condition describes."
    )


class FailureRecord(_Model):
    """The last member loss the operator acted on."""

    reason: str = Field("", max_length=128, description="Why the incarnation ended.")
    pod: str = Field("", max_length=253, description="The member pod that was lost.")
    time: str | None = Field(
        None, max_length=64, description="When (RFC 3339).", json_schema_extra=_DATE_TIME
    )
    message: str = Field("", max_length=4096, description="Details.")


class LeaseObservation(_Model):
    """The trainer Lease's last renewal as the operator saw it change, timed on its own clock.

    Why kept in status: the Lease's ``renewTime`` is written by the trainer's clock, which
    may be minutes off the operator's; like client-go's leader election, the operator only
    compares it with the previous value and times the silence itself. A restarted operator
    reads back when it first saw the current value instead of starting over.
    """

    holder: str = Field("", max_length=253, description="The Lease's holderIdentity.")
    renew_time: str = Field(
        "",
        max_length=64,
        description=(
            "The Lease's renewTime as the trainer wrote it: compared for change only, never "
            "with the operator's clock."
        ),
    )
    observed_at: str = Field(
        ...,
        max_length=64,
        description="When the operator first saw this holder and renewTime (its clock, RFC 3339).",
        json_schema_extra=_DATE_TIME,
    )


class MemberState(_Model):
    """One member of the current incarnation that has been replaced or is being replaced."""

    role: str = Field(..., max_length=32, description="The member's role (gym).")
    index: int = Field(..., ge=0, le=10_000, description="The member's index within its role.")
    generation: int = Field(
        0, ge=0, le=2**31, description="The generation its pod has (or is created with) now."
    )
    lost_at: str | None = Field(
        None,
        max_length=64,
        description="When the operator saw its last pod lost; unset once the new one is Ready.",
        json_schema_extra=_DATE_TIME,
    )
    lost_reason: str | None = Field(None, max_length=128, description="Why it was lost.")
    failures: int = Field(
        0, ge=0, le=2**31, description="Its losses counted as failures in this incarnation."
    )


class MemberReplacements(_Model):
    """Members of one role replaced while the run went on, and how long each took."""

    role: str = Field(..., max_length=32, description="The role (gym).")
    count: int = Field(0, ge=0, le=2**31, description="Replacements completed.")
    last_seconds: float | None = Field(
        None, ge=0, le=1e9, description="The last one: loss seen to the new pod Ready."
    )
    max_seconds: float | None = Field(
        None, ge=0, le=1e9, description="The longest one: loss seen to the new pod Ready."
    )
    recent_seconds: list[Annotated[float, Field(ge=0, le=1e9)]] = Field(
        default_factory=list,
        max_length=16,
        description="The last (at most 16) replacements' loss-to-Ready seconds, oldest first.",
    )


class RolloutRunStatus(_Model):
    """The observed state of a RolloutRun, written by the operator once per pass."""

    conditions: list[Condition] = Field(
        default_factory=list, max_length=16, description="Current conditions."
    )
    observed_generation: int | None = Field(
        None, ge=0, le=2**53, description="The spec generation the operator last acted on."
    )
    incarnation: int = Field(
        0, ge=0, le=2**31, description="Current incarnation; bumped on every restart."
    )
    restarts: int = Field(0, ge=0, le=2**31, description="Restarts caused by failures.")
    preemptions: int = Field(
        0, ge=0, le=2**31, description="Restarts caused by preemption or node loss."
    )
    last_failure: FailureRecord | None = Field(None, description="The last member loss.")
    train_step: int = Field(0, ge=0, le=2**53, description="Latest trainer step.")
    anchor_step: int | None = Field(
        None, ge=0, le=2**53, description="Trainer checkpoint step of the latest snapshot."
    )
    latest_manifest_uri: str | None = Field(
        None, max_length=2048, description="The latest published snapshot manifest."
    )
    latest_manifest_time: str | None = Field(
        None,
        max_length=64,
        description="When it was published (RFC 3339).",
        json_schema_extra=_DATE_TIME,
    )
    next_start_time: str | None = Field(
        None,
        max_length=64,
        description="When the next incarnation may start (backoff; RFC 3339).",
        json_schema_extra=_DATE_TIME,
    )
    incarnation_start_time: str | None = Field(
        None,
        max_length=64,
        description="When the current incarnation's trainer was started; unset while starting.",
        json_schema_extra=_DATE_TIME,
    )
    consecutive_losses: int = Field(
        0,
        ge=0,
        le=2**31,
        description=(
            "Incarnations lost to failures since the last stable one (preemptions restart "
            "without backoff and do not count); the backoff's exponent."
        ),
    )
    lease: LeaseObservation | None = Field(
        None,
        description=(
            "The current trainer's Lease renewal as last seen changing; the Lease counts as "
            "expired once it has not changed for leaseDurationSeconds of operator time."
        ),
    )
    last_reward: float | None = Field(
        None, ge=-1e15, le=1e15, description="Mean reward of the trainer's latest step."
    )
    step_rate: float | None = Field(
        None, ge=0, le=1e9, description="Trainer steps per minute over the last 60+ s."
    )
    step_window: str | None = Field(
        None, max_length=96, description="stepRate's window start: '<step>@<RFC 3339 time>'."
    )
    members: list[MemberState] = Field(
        default_factory=list,
        max_length=1024,
        description="Members of the current incarnation replaced or being replaced.",
    )
    member_replacements: list[MemberReplacements] = Field(
        default_factory=list,
        max_length=8,
        description="Members replaced while the run went on, by role, over the run's life.",
    )

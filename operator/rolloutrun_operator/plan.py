"""The vocabulary of a reconcile pass: actions, Events, member losses and the backoff.

Why separate from :mod:`rolloutrun_operator.reconcile`: the handlers apply these values and
the tests compare them, neither needs the decision logic; keeping them small frozen
dataclasses makes a table test's expected row readable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from rolloutrun_operator.api.v1alpha1 import RecoveryPolicy


class Verb(enum.StrEnum):
    """What to do with a child."""

    CREATE = "create"
    """Create it; an existing one of that name counts as done."""
    REPLACE = "replace"
    """Overwrite it with the manifest (only the ConfigMap is ever replaced)."""
    DELETE = "delete"
    """Delete it; a missing one counts as done."""


@dataclass(frozen=True)
class Action:
    """One API call on one child of the run."""

    verb: Verb
    kind: str
    name: str
    manifest: dict[str, Any] | None = None
    grace_seconds: int | None = None
    """For pod deletes: None keeps the pod's own grace period, 0 forces."""

    def __str__(self) -> str:
        grace = f" (grace {self.grace_seconds}s)" if self.grace_seconds is not None else ""
        return f"{self.verb} {self.kind}/{self.name}{grace}"


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the run, emitted after the status write."""

    type: str
    """``Normal`` or ``Warning``."""
    reason: str
    message: str


class LossKind(enum.StrEnum):
    """Whether a lost member counts against ``maxRestarts``."""

    FAILURE = "failure"
    PREEMPTION = "preemption"


@dataclass(frozen=True)
class Loss:
    """Why the current incarnation ends."""

    reason: str
    pod: str
    kind: LossKind
    message: str


def backoff_seconds(policy: RecoveryPolicy, consecutive_losses: int) -> int:
    """``backoffSeconds * 2^(k-1)`` for the k-th loss in a row, capped at ``maxBackoffSeconds``."""
    if consecutive_losses <= 0 or policy.backoff_seconds == 0:
        return 0
    exponent = min(consecutive_losses - 1, 32)
    return min(policy.backoff_seconds * 2**exponent, policy.max_backoff_seconds)

"""How patiently transient storage failures are retried, and how many tries one request gets.

Object stores answer 429/5xx under load and connections drop; GCS's guidance is to retry
with truncated exponential backoff and jitter, request by request. The retrying itself is
google-cloud-storage's (see :mod:`.gcs`): each HTTP request (one JSON call, one multipart
upload, one chunk of a resumable upload) is retried on its own, so a 503 on chunk 50 of a
checkpoint re-sends chunk 50, not the whole object. This module holds the policy (kept free
of Google imports so file:// users configure it too) and the per-request attempt budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently transient failures are retried.

    ``attempts`` counts the first try of each request; the delay before retry ``n``
    (0-based) is exponential from ``initial_delay`` by ``multiplier``, capped at
    ``max_delay``, with jitter.
    """

    attempts: int = 6
    initial_delay: float = 0.25
    max_delay: float = 8.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")


def backoff_cap(policy: RetryPolicy, retry_index: int) -> float:
    """The upper bound of the jittered delay before retry number ``retry_index`` (0-based)."""
    return min(policy.max_delay, policy.initial_delay * policy.multiplier**retry_index)


class AttemptBudget:
    """The tries one request has left: ``allow`` decides whether a failure is retried."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0

    def allow(self, transient: bool) -> bool:
        """Record a failure; True when it is transient and the request has tries left."""
        self.failures += 1
        return transient and self.failures < self.policy.attempts

"""Bounded retries with exponential backoff and full jitter for transient failures.

Object stores answer 429/5xx under load and connections drop; GCS's guidance is to retry
with truncated exponential backoff and jitter. Retrying lives here, above the backends'
error translation, so every operation shares one policy and a test can shrink the delays.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import TransientStorageError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently transient failures are retried.

    ``attempts`` counts the first try; the delay before retry ``n`` (0-based) is drawn
    uniformly from ``[0, min(max_delay, initial_delay * multiplier**n)]``.
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


def call_with_retry(
    op: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """Run ``op``; on :class:`TransientStorageError` back off and retry, up to the policy.

    The last transient error is re-raised once attempts are exhausted; any other exception
    propagates at once.
    """
    for attempt in range(policy.attempts):
        try:
            return op()
        except TransientStorageError as exc:
            if attempt + 1 >= policy.attempts:
                log.warning("giving up %s after %d attempts: %s", what, attempt + 1, exc)
                raise
            delay = rand() * backoff_cap(policy, attempt)
            log.info(
                "retrying %s in %.3fs (attempt %d of %d): %s",
                what,
                delay,
                attempt + 2,
                policy.attempts,
                exc,
            )
            sleep(delay)
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

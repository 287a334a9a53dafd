"""Constants shared by the storage tests (kept out of conftest.py so tests can import them)."""

from __future__ import annotations

from rolloutrun_runtime.storage import RetryPolicy

BUCKET = "rolloutrun-test"
"""The bucket the session's fake-gcs-server is created with."""

FAST_RETRY = RetryPolicy(attempts=4, initial_delay=0.01, max_delay=0.05)
"""Real backoff, tiny delays: retry tests stay fast."""

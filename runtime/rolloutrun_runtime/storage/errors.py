"""Storage errors: one hierarchy, every message naming the URI and the cause.

Callers (snapshot publication, restore, retention, the operator's status) must tell apart
"retry later" from "fix the configuration" without parsing backend-specific exceptions, so
each backend translates its own failures into these classes and chains the original as
``__cause__``.
"""

from __future__ import annotations


class StorageError(Exception):
    """A storage operation failed; ``uri`` names the object or location, ``reason`` why."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(f"{uri}: {reason}")
        self.uri = uri
        self.reason = reason


class UnsupportedStorageError(StorageError, ValueError):
    """The URI has a scheme or shape no backend handles (a configuration error)."""


class InvalidKeyError(StorageError, ValueError):
    """A key is not a clean relative '/'-separated path (empty part, '..', leading '/')."""


class ObjectNotFoundError(StorageError):
    """The object does not exist."""


class ObjectExistsError(StorageError):
    """A create-only write found the object already there (another writer won the race)."""


class StoragePermissionError(StorageError):
    """The credentials (or file permissions) do not allow the operation."""


class BucketNotFoundError(StorageError):
    """The gs:// bucket does not exist."""


class TransientStorageError(StorageError):
    """A temporary failure (HTTP 429/5xx, connection error) that outlived every retry."""

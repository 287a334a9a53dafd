"""Key validation: keys are clean relative paths, the same on every backend.

A key like ``a/../b`` or ``/etc/x`` would mean different things on a POSIX directory and in a
GCS bucket (where it is just a name), so both backends accept only keys that mean the same
thing everywhere. Names starting with :data:`TMP_PREFIX` are reserved for the file://
backend's in-flight temporary files, which readers must never see.
"""

from __future__ import annotations

import re

from .errors import InvalidKeyError

TMP_PREFIX = ".rr-tmp-"
"""Reserved name prefix of the file:// backend's temporary files."""

MAX_KEY_BYTES = 900
"""GCS allows 1024 bytes per object name; leave room for the base prefix."""

_CONTROL_CHARACTER = re.compile("[\x00-\x1f\x7f]")


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid key, or ``None`` when it is."""
    if not isinstance(key, str):
        return f"key must be a str, not {type(key).__name__}"
    if not key:
        return "key is empty"
    if key.startswith("/"):
        return "key must be relative (no leading '/')"
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        return f"key is longer than {MAX_KEY_BYTES} bytes"
    if _CONTROL_CHARACTER.search(key):
        return "key contains a control character"
    for part in key.split("/"):
        if not part:
            return "key has an empty path part ('//' or a trailing '/')"
        if part in (".", ".."):
            return f"key has a {part!r} path part"
        if part.startswith(TMP_PREFIX):
            return f"key part {part!r} uses the reserved prefix {TMP_PREFIX!r}"
    return None


def validate_key(key: str, *, base_uri: str) -> str:
    """Return ``key`` unchanged, or raise :class:`InvalidKeyError` naming the URI and why."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(f"{base_uri}/{key}" if isinstance(key, str) else base_uri, problem)
    return key


def normalize_prefix(prefix: str, *, base_uri: str) -> str:
    """A listing prefix: ``""`` (everything) or a valid key; one trailing '/' is tolerated."""
    if prefix == "":
        return ""
    stripped = prefix[:-1] if isinstance(prefix, str) and prefix.endswith("/") else prefix
    return validate_key(stripped, base_uri=base_uri)


def join_key(*parts: str) -> str:
    """Join key fragments with '/', skipping empty ones (``join_key("", "a")`` is ``"a"``)."""
    return "/".join(part.strip("/") for part in parts if part.strip("/"))


def entries_of(keys: list[str], prefix: str, marker_name: str) -> dict[str, bool]:
    """From a listing of ``prefix`` (``keys``, full keys): each folder directly under it that
    holds a key -> whether it holds ``marker_name`` directly (``list_entries``'s meaning)."""
    cut = len(prefix.rstrip("/")) + 1 if prefix else 0
    entries: dict[str, bool] = {}
    for key in keys:
        folder, slash, rest = key[cut:].partition("/")
        if slash:
            entries[folder] = entries.get(folder, False) or rest == marker_name
    return entries


def under_prefix(key: str, prefix: str) -> bool:
    """Whether ``key`` lies strictly under the (normalized) listing ``prefix``."""
    return prefix == "" or key.startswith(prefix + "/")


MAX_CREATE_ONLY_BYTES = 8 * 1024 * 1024
"""Create-only writes are commit markers and manifests: small, single-request uploads.

GCS (and fake-gcs-server, which honours preconditions only there) sends objects up to 8 MiB
in one multipart request; both backends enforce the same bound so code tested on file://
does not fail on gs://.
"""


def check_create_only_size(uri: str, size: int) -> None:
    """Raise ``ValueError`` naming ``uri`` if a create-only payload is too large."""
    if size > MAX_CREATE_ONLY_BYTES:
        raise ValueError(
            f"{uri}: create-only payload of {size} bytes exceeds {MAX_CREATE_ONLY_BYTES} bytes; "
            "commit markers and manifests must be small (write data files with write_bytes)"
        )

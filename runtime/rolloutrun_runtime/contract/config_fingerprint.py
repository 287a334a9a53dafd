"""The one fingerprint rule of a run config: sha256 over the canonical JSON of its flattened
view, some dotted keys left out.

Why its own module: the trainer checkpoint and the snapshot manifest both pin the config
they were written under by this fingerprint, and a reader compares it before restoring, so
the rule must be spelled once; it is a few lines of the standard library that need none of
the config's models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def fingerprint_of(view: Mapping[str, Any]) -> str:
    """sha256 of a flattened config view, in canonical JSON (the one fingerprint rule)."""
    return hashlib.sha256(json.dumps(dict(view), sort_keys=True).encode()).hexdigest()


def flatten(mapping: dict[str, Any], exclude: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Flatten nested mappings into ``{"a.b.c": value}``, dropping keys listed in ``exclude``."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if prefix in exclude:
            return
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat[prefix] = value

    walk("", mapping)
    return flat

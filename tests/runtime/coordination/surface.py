"""What coordination.py uses of ``kubernetes``, checked against the minimum supported version.

kubernetes_min_surface.json is recorded from kubernetes 29.0.0 by
record_kubernetes_surface.py. :class:`Recording` wraps the ApiClient and CoordinationV1Api
a KubernetesLease holds and logs only what coordination.py itself touches (the caller's
frame), so the library's own internals, which differ between versions, are not counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rolloutrun_runtime import coordination

SURFACE_PATH = Path(__file__).with_name("kubernetes_min_surface.json")


def surface() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SURFACE_PATH.read_text())
    return data


def _from_coordination(depth: int) -> bool:
    return sys._getframe(depth).f_code.co_filename == coordination.__file__


class Recording:
    """A transparent proxy that logs ``(kind, attribute, keyword names)`` coordination.py uses."""

    def __init__(self, target: Any, kind: str, log: list[tuple[str, str, tuple[str, ...]]]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not _from_coordination(2):
            return value
        self._log.append((self._kind, name, ()))
        if not callable(value):
            return value
        kind, log = self._kind, self._log

        def call(*args: Any, **kwargs: Any) -> Any:
            log.append((kind, name, tuple(sorted(kwargs))))
            return value(*args, **kwargs)

        return call


def violations(log: list[tuple[str, str, tuple[str, ...]]]) -> list[str]:
    """Each use in ``log`` the recorded minimum version does not offer."""
    known = surface()
    found = []
    for kind, name, keywords in log:
        if kind == "ApiClient":
            if name not in known["ApiClient"]:
                found.append(f"ApiClient.{name}")
        elif name not in known[kind]:
            found.append(f"{kind}.{name}")
        else:
            found += [f"{kind}.{name}({k}=)" for k in keywords if k not in known[kind][name]]
    return found

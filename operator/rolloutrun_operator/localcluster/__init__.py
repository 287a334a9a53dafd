"""A local Kubernetes cluster: an API server emulator and a process kubelet.

It speaks the Kubernetes HTTP API well enough that Kopf, the ``kubernetes`` client and
kubectl work against it unchanged, and runs pods as local processes, so the operator runs
on one machine without Docker, kind or a real API server: it is the operator's test bed and
the engine of the embedded default ``rolloutrun run``. The operator's reconcile code never
imports it. See ``docs/local-cluster.md`` for what it does and does not emulate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cluster import LocalCluster

__all__ = ["LocalCluster"]


def __getattr__(name: str) -> object:
    # Lazy, so ``rolloutrun cluster --help`` does not import aiohttp.
    if name == "LocalCluster":
        from .cluster import LocalCluster

        return LocalCluster
    raise AttributeError(name)

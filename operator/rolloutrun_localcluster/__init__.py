"""A local Kubernetes cluster: an API server emulator and a process kubelet.

It speaks the Kubernetes HTTP API well enough that Kopf, the ``kubernetes`` client and
kubectl work against it unchanged, and runs pods as local processes, so the operator runs
on one machine without Docker, kind or a real API server: it is the operator's test bed and
the engine of the embedded default ``rolloutrun run`` (:mod:`.embedded`, :mod:`.run_command`).

It is a package of its own, installed through the ``localcluster`` extra and left out of
the operator image: ``rolloutrun_operator`` never imports it (an import-linter contract in
``pyproject.toml``), and the ``rolloutrun`` CLI reaches it only through its entry points.
See ``docs/local-cluster.md`` for what it does and does not emulate.
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

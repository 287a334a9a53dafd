"""kubectl against a local cluster, as a user runs it: the tests that drive the cluster the
way users do (kubectl, helm) share this one runner instead of each spelling it."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually


def kubectl_result(
    cluster: LocalCluster, *args: str, stdin: str | None = None, namespace: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``kubectl args`` with the cluster's kubeconfig (``-n namespace`` first if given)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig_path)}
    scope = ["-n", namespace] if namespace is not None else []
    return subprocess.run(
        ["kubectl", *scope, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60
    )


def kubectl(
    cluster: LocalCluster, *args: str, stdin: str | None = None, namespace: str | None = None
) -> str:
    """The output of a ``kubectl args`` that must succeed (its stderr in the failure)."""
    done = kubectl_result(cluster, *args, stdin=stdin, namespace=namespace)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def run_ready(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    """A RolloutRun's Ready condition as ``kubectl get rr NAME -o json`` shows it (``{}``
    while it has none)."""
    found = json.loads(kubectl(cluster, "get", "rr", name, "-o", "json", namespace=namespace))
    conditions = (found.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Ready"), {})


def wait_for_ready_reason(
    cluster: LocalCluster, namespace: str, name: str, *reasons: str, interval: float = 0.5
) -> dict[str, Any]:
    """The run's Ready condition (through kubectl) once its reason is one of ``reasons``."""

    def with_reason() -> dict[str, Any] | None:
        condition = run_ready(cluster, namespace, name)
        return condition if condition.get("reason") in reasons else None

    return eventually(with_reason, timeout=120, interval=interval, what=" or ".join(reasons))

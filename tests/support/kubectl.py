"""kubectl against a local cluster, as a user runs it: the tests that drive the cluster the
way users do (kubectl, helm) share this one runner instead of each spelling it."""

from __future__ import annotations

import os
import subprocess

from rolloutrun_localcluster.cluster import LocalCluster


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

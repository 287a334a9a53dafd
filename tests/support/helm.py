"""helm against a local cluster, as a user runs it (the chart tests that install releases
share this runner; helm itself is fetched with ``make tools``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rolloutrun_localcluster.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / ".tools" / "helm"
CHART = ROOT / "charts" / "rolloutrun-operator"


def helm(cluster: LocalCluster, home: Path, *args: str) -> str:
    """The output of a ``helm args`` that must succeed, its state kept under ``home``."""
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig_path),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    done = subprocess.run([str(HELM), *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout

"""``rolloutrun cluster up`` in the foreground (Ctrl-C stops it and kills its pods), and
kubectl against the emulator when kubectl is installed."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.processes import pod_tag, tagged_pids
from rolloutrun_localcluster.testing import eventually
from tests.support.kubectl import kubectl as run_kubectl
from tests.support.kubectl import kubectl_result


def _rolloutrun() -> str:
    found = shutil.which("rolloutrun", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("the rolloutrun console script is not installed (pip install -e .)")
    return found


def _cluster_up(directory: Path) -> tuple[subprocess.Popen[str], Any]:
    """Start ``rolloutrun cluster up``; return it and a CoreV1Api once it printed its kubeconfig."""
    process = subprocess.Popen(
        [_rolloutrun(), "cluster", "up", "--dir", str(directory), "--pod-network", "127.9.0.0/16"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("kubeconfig:"):
            break
    kubeconfig = Path(lines[-1].split(":", 1)[1].strip())
    assert kubeconfig == directory.resolve() / "kubeconfig", lines
    core: Any = k8s.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    return process, core


def _start_forker(core: Any) -> tuple[str, set[int]]:
    pod = {
        "metadata": {"name": "forker"},
        "spec": {
            "containers": [{"name": "c", "image": "x", "command": ["sh", "-c", "sleep 300 & wait"]}]
        },
    }
    uid = core.create_namespaced_pod("default", pod).metadata.uid
    pids = eventually(
        lambda: (lambda p: p if len(p) >= 2 else None)(tagged_pids(pod_tag(uid))),
        what="pod processes",
    )
    return uid, pids


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


def test_cluster_up_serves_until_interrupted_and_kills_its_pods(tmp_path: Path) -> None:
    process, core = _cluster_up(tmp_path)
    try:
        uid, pids = _start_forker(core)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert not tagged_pids(pod_tag(uid)), f"pod processes {pids} outlived the cluster"
    finally:
        _stop(process)


def test_a_restarted_cluster_kills_what_a_killed_one_left(tmp_path: Path) -> None:
    process, core = _cluster_up(tmp_path)
    try:
        uid, _ = _start_forker(core)
        process.kill()  # no chance to clean up: its pods are orphaned
        process.wait()
        assert tagged_pids(pod_tag(uid)), "orphans expected after SIGKILL"
    finally:
        _stop(process)
    with LocalCluster(tmp_path, pod_network="127.9.0.0/16"):
        assert not tagged_pids(pod_tag(uid))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_works_unchanged(cluster: LocalCluster, widgets: Any, namespace: str) -> None:
    def kubectl(*args: str, stdin: str | None = None) -> str:
        return run_kubectl(cluster, *args, stdin=stdin, namespace=namespace)

    nodes = json.loads(kubectl("get", "nodes", "-o", "json"))
    assert [n["metadata"]["name"] for n in nodes["items"]] == ["local"]
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "kubectl-pod"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "x", "command": ["echo", "from kubectl"]}],
        },
    }
    assert "created" in kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    assert "unchanged" in kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/kubectl-pod", "--timeout=60s")
    assert kubectl("logs", "kubectl-pod") == "from kubectl\n"
    table = kubectl("get", "pods")
    assert (
        table.split()[:5] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"] and "Completed" in table
    )
    # kubectl validates on the server (fieldValidation=Strict): a custom resource's unknown
    # field is refused by name.
    bad = {"apiVersion": "test.rolloutrun.dev/v1", "kind": "Widget", "metadata": {"name": "bad"}}
    bad["spec"] = {"size": 1, "bogus": 1}
    failed = kubectl_result(cluster, "apply", "-f", "-", stdin=json.dumps(bad), namespace=namespace)
    assert failed.returncode != 0 and 'unknown field "spec.bogus"' in failed.stderr
    assert "deleted" in kubectl("delete", "pod", "kubectl-pod")

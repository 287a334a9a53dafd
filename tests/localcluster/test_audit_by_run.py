"""``rolloutrun audit --run NAME`` and ``rolloutrun trace --run NAME`` against the local
cluster: the RolloutRun's ``spec.storage`` names a ``file://`` path inside its pods and the
claim mounted there; the commands follow the claim to its volume on this machine and read
everything there (the checkpoint, the Gym audit file, the kept config, the trace).

Before: ``rolloutrun audit`` took only a log directory (on a cluster, the trainer pod's
emptyDir) and ``rolloutrun trace`` only a trace file from inside the pod.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutrun_localcluster.storage_provisioner import static_claim
from rolloutrun_runtime.cli import main as rolloutrun
from rolloutrun_runtime.storage import open_storage
from tests.support.audit_runs import write_stored_run
from tests.support.operator_cluster import CRD, GROUP, PLURAL, VERSION
from tests.support.rolloutruns import BASE


def _install_crd(client: Any) -> None:
    from kubernetes import client as k8s

    try:
        k8s.ApiextensionsV1Api(client).create_custom_resource_definition(
            yaml.safe_load(CRD.read_text())
        )
    except k8s.ApiException as error:
        if error.status != 409:  # another test of the session installed it
            raise


def test_audit_and_trace_find_a_run_by_name(
    cluster: Any, client: Any, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kubernetes import client as k8s

    volume = tmp_path / "volume"  # the claim's volume: the storage as the pods see it
    write_stored_run(open_storage(f"file://{volume}"), tmp_path / "scratch")
    _install_crd(client)
    pv, claim = static_claim("demo", namespace, volume)
    pv["metadata"]["name"] = f"{namespace}-demo-storage"
    claim["spec"]["volumeName"] = pv["metadata"]["name"]
    core = k8s.CoreV1Api(client)
    core.create_persistent_volume(pv)
    core.create_namespaced_persistent_volume_claim(namespace, claim)
    run = json.loads(json.dumps(BASE))
    run["metadata"] = {"name": "demo", "namespace": namespace}
    run["spec"]["storage"] = {"uri": "file:///data/demo", "volumeClaimName": "demo-storage"}
    k8s.CustomObjectsApi(client).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, run
    )
    where = ["--run", "demo", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig_path)]
    try:
        assert rolloutrun(["audit", *where, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["source"] == f"file://{volume}/step_1"
        assert report["side_effects"]["applied"] == 1

        assert rolloutrun(["trace", *where, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["runs"] == ["r0", "r1"]

        assert rolloutrun(["audit", "--run", "absent", *where[2:]]) == 2
        assert "RolloutRun " + namespace + "/absent: 404" in capsys.readouterr().err
    finally:
        core.delete_persistent_volume(pv["metadata"]["name"], _preload_content=False)

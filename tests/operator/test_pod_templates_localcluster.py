"""Pod templates on the local cluster, applied with kubectl as a user would: a trainer asking
for a GPU and tolerating a GPU node's taint is created with both, and a template overriding
a field of the operator's is kept by the API server and refused by the operator, by name.

What the local scheduler does with an extended resource: it ignores resources (see
``rolloutrun_localcluster.scheduler``), so the GPU trainer is bound and runs; a real
scheduler keeps it Pending (``Insufficient nvidia.com/gpu``) until a node advertises one.
Taints it does honour: the node here carries a ``NoSchedule`` GPU taint, so the member pods
run only because their templates tolerate it.
"""

from __future__ import annotations

import json
import shutil
import uuid
from typing import Any

import pytest

from rolloutrun_localcluster.testing import eventually
from tests.support.kubectl import kubectl
from tests.support.operator_cluster import (
    GROUP,
    STORAGE_CLAIM,
    VERSION,
    create_storage_claim,
    operator_thread,
)

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")

TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def rolloutrun(name: str, trainer_template: dict[str, Any]) -> dict[str, Any]:
    gym_template = {"spec": {"tolerations": [TOLERATE]}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutRun",
        "metadata": {"name": name},
        "spec": {
            "storage": {"uri": "file:///tmp/rolloutrun-test", "volumeClaimName": STORAGE_CLAIM},
            "gym": {"replicas": 1, "terminationGracePeriodSeconds": 2, "template": gym_template},
            "trainer": {"terminationGracePeriodSeconds": 2, "template": trainer_template},
            "recovery": {"backoffSeconds": 0, "leaseDurationSeconds": 2},
            "run": {
                "workers": {"backend": "inprocess"},
                # below the trainer's terminationGracePeriodSeconds, as the CRD requires
                "checkpointing": {"preemptionGraceSeconds": 1},
            },
        },
    }


GPU_TRAINER = {
    "metadata": {"labels": {"team": "rl"}},
    "spec": {
        "tolerations": [TOLERATE],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "containers": [
            {
                "name": "trainer",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            }
        ],
    },
}


def test_a_gpu_trainer_tolerating_the_gpu_taint_is_created_and_a_protected_field_refused(
    cluster, api
):
    namespace = f"tmpl-{uuid.uuid4().hex[:6]}"
    from kubernetes import client as k8s

    core: Any = k8s.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    create_storage_claim(core, namespace)
    taint = f"{TAINT['key']}={TAINT['value']}:{TAINT['effect']}"
    kubectl(cluster, "taint", "nodes", "--all", taint)

    def pod(name: str) -> dict[str, Any]:
        return json.loads(kubectl(cluster, "-n", namespace, "get", "pod", name, "-o", "json"))

    def ready(run: str) -> tuple[str, str, str] | None:
        body = json.loads(kubectl(cluster, "-n", namespace, "get", "rr", run, "-o", "json"))
        for item in (body.get("status") or {}).get("conditions") or []:
            if item["type"] == "Ready":
                return item["status"], item.get("reason", ""), item.get("message", "")
        return None

    try:
        with operator_thread(cluster, namespace):
            kubectl(
                cluster, "-n", namespace, "apply", "-f", "-",
                stdin=json.dumps(rolloutrun("gpu", GPU_TRAINER)),
            )  # fmt: skip
            eventually(lambda: (ready("gpu") or ("",))[0] == "True", what="the GPU run ready")
            trainer = pod("gpu-i1-trainer")
            (container,) = trainer["spec"]["containers"]
            assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
            assert TOLERATE in trainer["spec"]["tolerations"]
            assert trainer["metadata"]["labels"]["team"] == "rl"
            assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
            # the local scheduler ignores resources: bound and running (a real one would
            # wait for a node with a free nvidia.com/gpu)
            assert trainer["spec"]["nodeName"] and trainer["status"]["phase"] == "Running"
            assert TOLERATE in pod("gpu-i1-gym-0")["spec"]["tolerations"]

            override = json.loads(json.dumps(GPU_TRAINER))
            override["spec"]["containers"][0]["command"] = ["sh", "-c", "cat /var/run/secrets/*"]
            kubectl(
                cluster, "-n", namespace, "apply", "-f", "-",
                stdin=json.dumps(rolloutrun("override", override)),
            )  # fmt: skip
            stored = json.loads(
                kubectl(cluster, "-n", namespace, "get", "rr", "override", "-o", "json")
            )
            # kept by the API server (declared in the schema), not pruned ...
            assert stored["spec"]["trainer"]["template"]["spec"]["containers"][0]["command"]
            # ... and refused by the operator, naming the field
            eventually(lambda: (ready("override") or ("", ""))[1] == "InvalidSpec", what="refused")
            status, _, message = ready("override") or ("", "", "")
            assert status == "False"
            assert "spec.trainer.template.spec.containers.0.command: " in message
            assert "protected" in message
            pods = core.list_namespaced_pod(namespace, label_selector="rolloutrun.dev/run=override")
            assert pods.items == []
    finally:
        kubectl(cluster, "taint", "nodes", "--all", f"{taint}-")


def test_the_lease_binding_follows_a_switched_service_account(cluster, api):
    """A run switched to a consenting account (say, one with a Workload Identity) binds its
    Lease Role to it at once, keeps the running trainer's account bound until that trainer
    is gone, then binds the new account alone; the next trainer runs as it."""
    namespace = f"sa-{uuid.uuid4().hex[:6]}"
    from kubernetes import client as k8s

    core: Any = k8s.CoreV1Api(api)
    rbac: Any = k8s.RbacAuthorizationV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    create_storage_claim(core, namespace)
    allow = {"rolloutrun.dev/allow-runs": "true", "iam.gke.io/gcp-service-account": "x@p.iam"}
    core.create_namespaced_service_account(
        namespace, {"metadata": {"name": "robot", "annotations": allow}}
    )

    def bound() -> list[str]:
        binding = rbac.read_namespaced_role_binding("switch-member", namespace)
        return sorted(subject.name for subject in binding.subjects)

    def account(pod: str) -> str | None:
        try:
            return str(core.read_namespaced_pod(pod, namespace).spec.service_account_name)
        except k8s.ApiException:
            return None

    with operator_thread(cluster, namespace) as operator:
        body = rolloutrun("switch", {})
        kubectl(cluster, "-n", namespace, "apply", "-f", "-", stdin=json.dumps(body))
        eventually(lambda: account("switch-i1-trainer") == "switch-member", what="trainer 1")
        assert bound() == ["switch-member"]
        patch = json.dumps({"spec": {"serviceAccountName": "robot"}})
        kubectl(cluster, "-n", namespace, "patch", "rr", "switch", "--type", "merge", "-p", patch)
        eventually(lambda: bound() == ["robot", "switch-member"], what="both bound")
        core.delete_namespaced_pod("switch-i1-trainer", namespace)
        eventually(lambda: account("switch-i2-trainer") == "robot", what="trainer 2 as robot")
        eventually(lambda: bound() == ["robot"], what="the old account unbound")
    assert operator.error is None

"""PodDisruptionBudgets on the local cluster: the disruption controller's status (pure rules
and as the cluster computes them), the eviction subresource honouring a budget, and the
chart's PDB installed by helm holding back ``kubectl drain``."""

from __future__ import annotations

import shutil
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rolloutrun_localcluster import disruption, errors
from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.store import rfc3339
from rolloutrun_localcluster.testing import eventually
from tests.support.helm import CHART, HELM, helm
from tests.support.kubectl import kubectl, kubectl_result

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def pod(name: str, ready: bool = True, phase: str = "Running", **meta: Any) -> dict[str, Any]:
    status = "True" if ready else "False"
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "a"}, **meta},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": status}]},
    }


def budget(spec: dict[str, Any], status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "b", "namespace": "ns", "generation": 1},
        "spec": {"selector": {"matchLabels": {"app": "a"}}, **spec},
        "status": status or {},
    }


def no_owner(uid: str) -> None:
    return None


def test_status_counts_ready_pods_against_min_available() -> None:
    pods = [pod("p1"), pod("p2"), pod("p3", ready=False), pod("other", labels={"app": "z"})]
    status = disruption.budget_status(budget({"minAvailable": 1}), pods, no_owner, NOW)
    assert {k: status[k] for k in ("expectedPods", "currentHealthy", "desiredHealthy")} == {
        "expectedPods": 3,
        "currentHealthy": 2,
        "desiredHealthy": 1,
    }
    assert status["disruptionsAllowed"] == 1 and status["observedGeneration"] == 1
    (allowed,) = status["conditions"]
    assert (allowed["type"], allowed["status"], allowed["reason"]) == (
        "DisruptionAllowed",
        "True",
        "SufficientPods",
    )
    # a pod just evicted (in disruptedPods) is not healthy; one being deleted neither
    evicted = {"disruptedPods": {"p1": rfc3339(NOW - timedelta(seconds=5))}}
    deleting = pod("p2", deletionTimestamp=rfc3339(NOW))
    status = disruption.budget_status(
        budget({"minAvailable": 1}, evicted), [pod("p1"), deleting], no_owner, NOW
    )
    assert (status["currentHealthy"], status["disruptionsAllowed"]) == (0, 0)
    assert status["disruptedPods"] == evicted["disruptedPods"]
    assert status["conditions"][0]["reason"] == "InsufficientPods"
    assert disruption.next_expiry(status, NOW) == 115.0  # looked at again when it expires
    late = NOW + timedelta(minutes=3)
    assert (
        disruption.budget_status(budget({"minAvailable": 1}, evicted), [pod("p1")], no_owner, late)[
            "currentHealthy"
        ]
        == 1
    )  # the eviction never went through: healthy again


def test_percentages_and_max_unavailable_scale_by_the_pods_controller() -> None:
    deployment = {"kind": "Deployment", "metadata": {"uid": "d"}, "spec": {"replicas": 4}}
    replica_set = {
        "kind": "ReplicaSet",
        "metadata": {
            "uid": "rs",
            "ownerReferences": [{"kind": "Deployment", "uid": "d", "controller": True}],
        },
        "spec": {"replicas": 4},
    }
    owners = {"d": deployment, "rs": replica_set}
    owned = [{"kind": "ReplicaSet", "uid": "rs", "controller": True}]
    pods = [pod(f"p{i}", ownerReferences=owned) for i in range(3)]
    status = disruption.budget_status(budget({"maxUnavailable": "25%"}), pods, owners.get, NOW)
    assert (status["expectedPods"], status["desiredHealthy"], status["disruptionsAllowed"]) == (
        4,
        3,
        0,
    )
    status = disruption.budget_status(budget({"minAvailable": "50%"}), pods, owners.get, NOW)
    assert (status["desiredHealthy"], status["disruptionsAllowed"]) == (2, 1)
    # a pod without a controller: the controller fails safe (nothing may be disrupted)
    status = disruption.budget_status(budget({"maxUnavailable": 1}), [pod("bare")], owners.get, NOW)
    assert status["disruptionsAllowed"] == 0
    assert status["conditions"][0]["reason"] == "SyncFailed"
    assert status["conditions"][0]["message"] == 'found no controller ref for pod "bare"'


def test_eviction_takes_an_allowed_disruption_or_is_refused_with_429() -> None:
    ready = {
        "observedGeneration": 1,
        "currentHealthy": 2,
        "desiredHealthy": 1,
        "disruptionsAllowed": 1,
    }
    verdict = disruption.evict(pod("p1"), [budget({"minAvailable": 1}, ready)], NOW)
    assert verdict.status is not None and verdict.status["disruptionsAllowed"] == 0
    assert verdict.status["disruptedPods"] == {"p1": rfc3339(NOW)}
    spent = {**ready, "currentHealthy": 1, "disruptionsAllowed": 0}
    with pytest.raises(errors.ApiError) as refused:
        disruption.evict(pod("p2"), [budget({"minAvailable": 1}, spent)], NOW)
    assert (refused.value.code, refused.value.reason, refused.value.message) == (
        429,
        "TooManyRequests",
        "Cannot evict pod as it would violate the pod's disruption budget.",
    )
    assert refused.value.details == {
        "causes": [
            {
                "reason": "DisruptionBudget",
                "message": "The disruption budget b needs 1 healthy pods and has 1 currently",
            }
        ]
    }
    # not yet seen by the controller: 429, come back in 10 s
    with pytest.raises(errors.ApiError) as unseen:
        disruption.evict(pod("p2"), [budget({"minAvailable": 1})], NOW)
    assert unseen.value.code == 429 and unseen.value.details["retryAfterSeconds"] == 10
    # pending, finished or unready-while-the-budget-holds pods, and uncovered ones, just go
    for free in (pod("p", phase="Pending"), pod("p", phase="Succeeded"), pod("p", labels={})):
        assert disruption.evict(free, [budget({"minAvailable": 1}, spent)], NOW).budget is None
    assert (
        disruption.evict(pod("p", ready=False), [budget({"minAvailable": 1}, spent)], NOW).budget
        is None
    )
    two = [budget({"minAvailable": 1}, ready), budget({"maxUnavailable": 1}, ready)]
    with pytest.raises(errors.ApiError, match="more than one PodDisruptionBudget"):
        disruption.evict(pod("p1"), two, NOW)


def test_an_eviction_marks_the_pod_a_disruption_target_first() -> None:
    """As the API server's eviction does: DisruptionTarget=True (EvictionByEvictionAPI) on
    the pod before the delete, so an operator can tell a drain from a plain delete."""
    status = disruption.evicting_status(pod("p"), NOW)
    target = status["conditions"][-1]
    assert target == {
        "type": "DisruptionTarget",
        "status": "True",
        "lastTransitionTime": rfc3339(NOW),
        "reason": "EvictionByEvictionAPI",
        "message": "Eviction API: evicting",
    }
    assert status["conditions"][0] == {"type": "Ready", "status": "True"}  # the rest kept
    again = disruption.evicting_status({**pod("p"), "status": status}, NOW + timedelta(hours=1))
    assert again["conditions"] == status["conditions"]  # once True, its transition time stays
    meta = {"uid": "u1", "resourceVersion": "7"}
    current = pod("p", **meta)
    assert disruption.preconditions_hold(current, {})
    assert disruption.preconditions_hold(current, {"preconditions": meta})
    assert not disruption.preconditions_hold(current, {"preconditions": {"uid": "u2"}})
    assert not disruption.preconditions_hold(current, {"preconditions": {"resourceVersion": "6"}})
    moved = disruption.after_own_write({"preconditions": meta}, pod("p", resourceVersion="8"))
    assert moved == {"preconditions": {"uid": "u1", "resourceVersion": "8"}}
    assert disruption.after_own_write({"gracePeriodSeconds": 1}, current) == {
        "gracePeriodSeconds": 1
    }


def test_an_evicted_pod_says_so_while_it_terminates(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    hold = "example.com/hold"  # keeps the deleted pod readable
    container = {"name": "c", "image": "x", "command": ["sleep", "60"]}
    body = {
        "metadata": {"name": "evicted", "finalizers": [hold]},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 1},
    }
    created = core.create_namespaced_pod(namespace, body)

    def running() -> bool:
        return core.read_namespaced_pod("evicted", namespace).status.phase == "Running"

    eventually(running, what="the pod running")
    stale = {"preconditions": {"resourceVersion": "1"}}
    eviction = {"metadata": {"name": "evicted", "namespace": namespace}}
    with pytest.raises(k8s.ApiException) as conflict:
        core.create_namespaced_pod_eviction(
            "evicted", namespace, {**eviction, "deleteOptions": stale}
        )
    assert conflict.value.status == 409
    unchanged = core.read_namespaced_pod("evicted", namespace)
    assert not [c for c in unchanged.status.conditions or [] if c.type == "DisruptionTarget"]
    rv = {
        "preconditions": {
            "uid": created.metadata.uid,
            "resourceVersion": unchanged.metadata.resource_version,
        }
    }
    core.create_namespaced_pod_eviction("evicted", namespace, {**eviction, "deleteOptions": rv})
    try:
        going = core.read_namespaced_pod("evicted", namespace)
        assert going.metadata.deletion_timestamp is not None
        (target,) = [c for c in going.status.conditions if c.type == "DisruptionTarget"]
        assert (target.status, target.reason) == ("True", "EvictionByEvictionAPI")

        def stopped() -> Any:
            pod = core.read_namespaced_pod("evicted", namespace)
            (state,) = pod.status.container_statuses
            return pod if state.state.terminated is not None else None

        # the kubelet's own status writes as it stops the pod keep the condition
        ended = eventually(stopped, what="the evicted pod's container stopped by its kubelet")
        kinds = [c.type for c in ended.status.conditions]
        assert "DisruptionTarget" in kinds and "Ready" in kinds
    finally:
        core.patch_namespaced_pod("evicted", namespace, {"metadata": {"finalizers": None}})


def test_a_budget_is_served_validated_and_computed(client: Any, namespace: str) -> None:
    policy: Any = k8s.PolicyV1Api(client)
    core: Any = k8s.CoreV1Api(client)
    body = {"metadata": {"name": "both"}, "spec": {"minAvailable": 1, "maxUnavailable": 1}}
    with pytest.raises(k8s.ApiException) as invalid:
        policy.create_namespaced_pod_disruption_budget(namespace, body)
    assert invalid.value.status == 422 and "cannot be both set" in invalid.value.body
    selector = {"matchLabels": {"app": "kept"}}
    policy.create_namespaced_pod_disruption_budget(
        namespace, {"metadata": {"name": "kept"}, "spec": {"minAvailable": 1, "selector": selector}}
    )
    for name in ("a", "b"):
        container = {"name": "c", "image": "x", "command": ["sleep", "60"]}
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {"name": name, "labels": {"app": "kept"}},
                "spec": {"containers": [container]},
            },
        )

    def computed() -> Any:
        status = policy.read_namespaced_pod_disruption_budget_status("kept", namespace).status
        return status if status.current_healthy == 2 and status.disruptions_allowed == 1 else None

    status = eventually(computed, what="the budget's status from two ready pods")
    assert (status.expected_pods, status.desired_healthy, status.observed_generation) == (2, 1, 1)
    eviction = {"metadata": {"name": "a", "namespace": namespace}}
    core.create_namespaced_pod_eviction("a", namespace, eviction)
    with pytest.raises(k8s.ApiException) as refused:
        core.create_namespaced_pod_eviction(
            "b", namespace, {"metadata": {"name": "b", "namespace": namespace}}
        )
    assert refused.value.status == 429
    assert "would violate the pod's disruption budget" in refused.value.body
    core.read_namespaced_pod("b", namespace)  # still there


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_helm_installs_the_charts_pdb_and_kubectl_drain_respects_it(
    cluster: LocalCluster, client: Any, namespace: str, tmp_path: Path
) -> None:
    """The chart with two replicas (peering) renders its PDB; the cluster serves it
    (``kubectl get``/``describe``), and ``kubectl drain`` evicts one of two ready operator
    pods, then is refused the other (429, retried until its timeout)."""
    if not HELM.exists():
        pytest.skip("helm is fetched with `make tools`")
    core: Any = k8s.CoreV1Api(client)
    release = f"d{uuid.uuid4().hex[:6]}"
    install = ("--namespace", namespace, "--set", "peering.enabled=true")
    helm(
        cluster,
        tmp_path,
        "install",
        release,
        str(CHART),
        *install,
        "--set",
        f"peering.name={release}",
    )
    try:
        full = f"{release}-rolloutrun-operator"
        listed = kubectl(cluster, "get", "pdb", namespace=namespace)
        assert listed.split("\n")[0].split() == [
            "NAME",
            "MIN",
            "AVAILABLE",
            "MAX",
            "UNAVAILABLE",
            "ALLOWED",
            "DISRUPTIONS",
            "AGE",
        ]
        assert listed.split("\n")[1].split()[:4] == [full, "1", "N/A", "0"]
        labels = {
            "app.kubernetes.io/name": "rolloutrun-operator",
            "app.kubernetes.io/instance": release,
        }
        for name in (
            "op-a",
            "op-b",
        ):  # as the Deployment would run them (the cluster runs no Deployments)
            container = {"name": "operator", "image": "x", "command": ["sleep", "60"]}
            core.create_namespaced_pod(
                namespace,
                {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [container]}},
            )

        def allowed() -> bool:
            text = kubectl(cluster, "describe", "pdb", full, namespace=namespace)
            return "Allowed disruptions:  1" in text and "Current:              2" in text

        eventually(allowed, what="the chart's budget allowing one disruption")
        drain = ("drain", "local", "--force", "--grace-period=1", "--timeout=8s")
        done = kubectl_result(
            cluster, *drain, f"--pod-selector=app.kubernetes.io/instance={release}"
        )
        assert done.returncode != 0, done.stdout
        assert done.stdout.count("evicted") == 1, done.stdout
        assert "Cannot evict pod as it would violate the pod's disruption budget." in done.stderr
        (left,) = core.list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/instance={release}"
        ).items
        assert left.metadata.deletion_timestamp is None
    finally:
        kubectl(cluster, "uncordon", "local")
        helm(cluster, tmp_path, "uninstall", release, "--namespace", namespace)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_creates_a_budget_as_protobuf_and_prints_it(
    cluster: LocalCluster, namespace: str
) -> None:
    created = kubectl(
        cluster,
        "create",
        "pdb",
        "web",
        "--selector=app=web",
        "--max-unavailable=50%",
        namespace=namespace,
    )
    assert created == "poddisruptionbudget.policy/web created\n"
    spec = kubectl(cluster, "get", "pdb", "web", "-o", "jsonpath={.spec}", namespace=namespace)
    assert '"maxUnavailable":"50%"' in spec and '"matchLabels":{"app":"web"}' in spec
    row = kubectl(cluster, "get", "pdb", "web", "--no-headers", namespace=namespace).split()
    assert row[:4] == ["web", "N/A", "50%", "0"]

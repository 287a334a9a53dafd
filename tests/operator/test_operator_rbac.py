"""The operator under least privilege on the local cluster, which enforces RBAC: with the
chart's rules (``kube.permission_rules``) it runs a RolloutRun and its trainer's token
reaches its own Lease and nothing else; with one rule missing the run stops at a 403 that
names the missing permission, as it would on a real cluster."""

from __future__ import annotations

import json
from typing import Any

import urllib3

from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator.kube import PERMISSIONS, permission_rules
from tests.support.operator_cluster import GROUP, PLURAL, VERSION, RunNamespace, operator_thread
from tests.support.operator_cluster import rolloutrun as stand_in_run


def rolloutrun(name: str) -> dict[str, Any]:
    uri = "file:///tmp/rolloutrun-rbac-test"
    return stand_in_run(name, storage_uri=uri, gym_replicas=1, lease_seconds=30)


def test_under_the_charts_rules_the_run_starts_and_the_trainer_reaches_only_its_lease(cluster, api):
    ns = RunNamespace(api, "rb")
    with operator_thread(cluster, ns.name):
        ns.create_run(rolloutrun("demo"))
        eventually(
            lambda: ns.ready_condition("demo").get("reason") == "Running", what="run running"
        )
        directory = eventually(
            lambda: cluster.pod_dir(ns.name, "demo-i1-trainer"), what="trainer dir"
        )
        token = eventually(
            lambda: (
                (directory / "serviceaccount" / "token").exists()
                and (directory / "serviceaccount" / "token").read_text()
            ),
            what="the trainer's token",
        )
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))

    def call(method: str, path: str, body: Any = None) -> Any:
        return http.request(
            method,
            f"{cluster.api_url}{path}",
            body=None if body is None else json.dumps(body),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )

    leases = f"/apis/coordination.k8s.io/v1/namespaces/{ns.name}/leases"
    own = call("GET", f"{leases}/demo-trainer")
    assert own.status == 200  # what the trainer does: read and renew its Lease
    assert call("PUT", f"{leases}/demo-trainer", json.loads(own.data)).status == 200
    account = f"system:serviceaccount:{ns.name}:demo-member"
    for method, path in (
        ("GET", f"{leases}/other-trainer"),
        ("POST", leases),
        ("GET", f"/api/v1/namespaces/{ns.name}/pods"),
        ("GET", f"/api/v1/namespaces/{ns.name}/secrets/demo-gym-token"),
        ("DELETE", f"/api/v1/namespaces/{ns.name}/pods/demo-i1-gym-0"),
        ("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{ns.name}/{PLURAL}/demo"),
    ):
        answer = call(method, path, {} if method == "POST" else None)
        assert answer.status == 403, (method, path, answer.data)
        assert f'User "{account}" cannot' in json.loads(answer.data)["message"]


def test_without_pods_create_the_run_stops_at_a_403_naming_the_permission(cluster, api):
    ns = RunNamespace(api, "rb")
    narrowed = [
        (group, resource, tuple(v for v in verbs if v != "create") if resource == "pods" else verbs)
        for group, resource, verbs in PERMISSIONS
    ]
    with operator_thread(cluster, ns.name, permission_rules(narrowed)):
        ns.create_run(rolloutrun("starved"))
        eventually(
            lambda: ns.ready_condition("starved").get("reason") == "ChildRejected",
            what="the refusal",
        )
        message = ns.ready_condition("starved")["message"]
    operator = f"system:serviceaccount:rolloutrun-system:rolloutrun-operator-{ns.name}"
    assert "403 Forbidden" in message
    assert (
        f'pods is forbidden: User "{operator}" cannot create resource "pods" in API group "" '
        f'in the namespace "{ns.name}"'
    ) in message
    assert ns.core.list_namespaced_pod(ns.name).items == []

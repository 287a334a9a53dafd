"""RBAC enforced by the local cluster, seen through real clients: ``kubectl auth can-i`` for
several identities answers as the Roles say, a 403 reads as kubectl prints it for a real
server, each pod gets its own account's token (dead once the account is deleted), and
impersonation and escalation need their own rights."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually

KUBECTL = shutil.which("kubectl")
RBAC = "rbac.authorization.k8s.io"
LEASES = {
    "apiGroups": ["coordination.k8s.io"],
    "resources": ["leases"],
    "resourceNames": ["mine"],
    "verbs": ["get", "update"],
}


def kubectl(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    command = [KUBECTL, "--kubeconfig", str(cluster.kubeconfig_path), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def grant(client: Any, namespace: str, name: str, account: str, *rules: dict[str, Any]) -> None:
    """A Role ``name`` with ``rules`` bound to the ServiceAccount ``account``."""
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": list(rules)})
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        },
    )


def accounts(client: Any, namespace: str, *names: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    for name in names:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})


def request(cluster: LocalCluster, method: str, path: str, token: str, **kw: Any) -> Any:
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
    return http.request(method, f"{cluster.api_url}{path}", headers=headers, **kw)


def test_kubectl_auth_can_i_answers_as_the_roles_say(cluster, client, namespace):
    accounts(client, namespace, "bob", "carol")
    grant(client, namespace, "lease-one", "bob", LEASES)
    readers = f"readers-{namespace}"
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    rule = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}
    rbac.create_cluster_role({"metadata": {"name": readers}, "rules": [rule]})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": readers},
            "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": readers},
            "subjects": [{"kind": "Group", "name": readers}],
        }
    )
    bob = f"system:serviceaccount:{namespace}:bob"
    carol = f"system:serviceaccount:{namespace}:carol"
    cases = [
        ((), "create pods", "yes"),
        ((), "delete nodes", "yes"),
        (("--as", bob), "get leases/mine", "yes"),
        (("--as", bob), "update leases/mine", "yes"),
        (("--as", bob), "patch leases/mine", "no"),
        (("--as", bob), "get leases/other", "no"),
        (("--as", bob), "create leases", "no"),
        (("--as", bob), "list pods", "no"),
        (("--as", carol), "get leases/mine", "no"),
        (("--as", "alice", "--as-group", readers), "get nodes/n1", "yes"),
        (("--as", "alice"), "get nodes/n1", "no"),
        (("--as", bob), "create selfsubjectaccessreviews.authorization.k8s.io", "yes"),
    ]
    for identity, action, expected in cases:
        answer = kubectl(cluster, "auth", "can-i", *action.split(), "-n", namespace, *identity)
        assert answer.stdout.strip() == expected, (identity, action, answer.stderr)
        assert answer.returncode == (0 if expected == "yes" else 1)
    elsewhere = kubectl(
        cluster, "auth", "can-i", "get", "leases/mine", "-n", "default", "--as", bob
    )
    assert elsewhere.stdout.strip() == "no"
    listed = kubectl(cluster, "auth", "can-i", "--list", "-n", namespace, "--as", bob)
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert ["leases.coordination.k8s.io", "[]", "[mine]", "[get", "update]"] in rows, listed
    whoami = kubectl(cluster, "auth", "whoami", "-o", "json", "--as", bob)
    info = json.loads(whoami.stdout)["status"]["userInfo"]
    assert info["username"] == bob
    assert info["groups"] == [
        "system:serviceaccounts",
        f"system:serviceaccounts:{namespace}",
        "system:authenticated",
    ]
    rbac.delete_cluster_role_binding(readers)
    rbac.delete_cluster_role(readers)


def test_a_403_reads_as_kubectl_prints_it_for_a_real_server(cluster, client, namespace):
    accounts(client, namespace, "bob")
    bob = f"system:serviceaccount:{namespace}:bob"
    listed = kubectl(cluster, "get", "pods", "-n", namespace, "--as", bob)
    assert listed.returncode == 1
    assert listed.stderr.strip() == (
        f'Error from server (Forbidden): pods is forbidden: User "{bob}" cannot list resource '
        f'"pods" in API group "" in the namespace "{namespace}"'
    )
    nodes = kubectl(cluster, "get", "nodes", "local", "--as", bob)
    assert nodes.stderr.strip() == (
        f'Error from server (Forbidden): nodes "local" is forbidden: User "{bob}" cannot get '
        'resource "nodes" in API group "" at the cluster scope'
    )
    logs = kubectl(cluster, "logs", "nothing", "-n", namespace, "--as", bob)
    assert (
        f'pods "nothing" is forbidden: User "{bob}" cannot get resource "pods" in API group ""'
        in logs.stderr
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_pod_gets_its_accounts_token_which_dies_with_the_account(cluster, client, namespace):
    accounts(client, namespace, "bob")
    grant(client, namespace, "lease-one", "bob", LEASES)
    coordination: Any = k8s.CoordinationV1Api(client)
    coordination.create_namespaced_lease(namespace, {"metadata": {"name": "mine"}, "spec": {}})
    coordination.create_namespaced_lease(namespace, {"metadata": {"name": "other"}, "spec": {}})
    core: Any = k8s.CoreV1Api(client)
    pod = {
        "metadata": {"name": "bobs"},
        "spec": {
            "serviceAccountName": "bob",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "c", "image": "x", "command": ["sleep", "300"]}],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    directory = eventually(lambda: cluster.pod_dir(namespace, "bobs"), what="the pod's dir")
    token_file = directory / "serviceaccount" / "token"
    eventually(token_file.exists, what="the mounted token")
    assert _mode(token_file) == 0o600 and _mode(token_file.parent) == 0o700
    token = token_file.read_text()
    assert token != cluster.token
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    assert request(cluster, "GET", f"{lease}/mine", token).status == 200
    body = json.loads(request(cluster, "GET", f"{lease}/mine", token).data)
    put = request(cluster, "PUT", f"{lease}/mine", token, body=json.dumps(body))
    assert put.status == 200
    denied = request(cluster, "GET", f"{lease}/other", token)
    assert denied.status == 403
    assert json.loads(denied.data) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'leases.coordination.k8s.io "other" is forbidden: User '
        f'"system:serviceaccount:{namespace}:bob" cannot get resource "leases" in API group '
        f'"coordination.k8s.io" in the namespace "{namespace}"',
        "reason": "Forbidden",
        "details": {"name": "other", "group": "coordination.k8s.io", "kind": "leases"},
        "code": 403,
    }
    assert request(cluster, "GET", "/apis", token).status == 200  # discovery for everyone
    # a TokenRequest (`kubectl create token bob`) gives another token of the same account
    minted = kubectl(cluster, "create", "token", "bob", "-n", namespace, "--duration", "20m")
    assert minted.returncode == 0, minted.stderr
    assert request(cluster, "GET", f"{lease}/mine", minted.stdout.strip()).status == 200
    core.delete_namespaced_service_account("bob", namespace)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "bob"}})
    for dead in (token, minted.stdout.strip()):
        answer = request(cluster, "GET", f"{lease}/mine", dead)
        assert answer.status == 401 and json.loads(answer.data)["reason"] == "Unauthorized"


def test_impersonation_and_escalation_need_their_own_rights(cluster, client, namespace):
    accounts(client, namespace, "bob")
    author = {"apiGroups": [RBAC], "resources": ["roles"], "verbs": ["create"]}
    grant(client, namespace, "author", "bob", author)
    minted = kubectl(cluster, "create", "token", "bob", "-n", namespace)
    token = minted.stdout.strip()
    pods = f"/api/v1/namespaces/{namespace}/pods"
    acting = request(cluster, "GET", pods, token, headers={"Impersonate-User": "system:admin"})
    assert acting.status == 403
    assert json.loads(acting.data)["message"] == (
        f'users "system:admin" is forbidden: User "system:serviceaccount:{namespace}:bob" '
        'cannot impersonate resource "users" in API group "" at the cluster scope'
    )
    role = {
        "apiVersion": f"{RBAC}/v1",
        "kind": "Role",
        "metadata": {"name": "leases"},
        "rules": [LEASES],
    }
    roles = f"/apis/{RBAC}/v1/namespaces/{namespace}/roles"
    headers = {"Content-Type": "application/json"}
    refused = request(cluster, "POST", roles, token, body=json.dumps(role), headers=headers)
    assert refused.status == 403
    assert json.loads(refused.data)["message"] == (
        f'roles.{RBAC} "leases" is forbidden: user "system:serviceaccount:{namespace}:bob" '
        f'(groups=["system:serviceaccounts" "system:serviceaccounts:{namespace}" '
        '"system:authenticated"]) is attempting to grant RBAC permissions not currently held:\n'
        '{APIGroups:["coordination.k8s.io"], Resources:["leases"], ResourceNames:["mine"], '
        'Verbs:["get" "update"]}'
    )
    grant(client, namespace, "holder", "bob", LEASES)  # held now: it may grant it
    made = request(cluster, "POST", roles, token, body=json.dumps(role), headers=headers)
    assert made.status == 201, made.data
    # an admin asks for another subject (SubjectAccessReview)
    review: Any = k8s.AuthorizationV1Api(client).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:{namespace}:bob",
                "groups": ["system:serviceaccounts"],
                "resourceAttributes": {
                    "namespace": namespace,
                    "verb": "create",
                    "group": RBAC,
                    "resource": "roles",
                },
            }
        }
    )
    assert review.status.allowed is True
    assert review.status.reason == (
        f'RBAC: allowed by RoleBinding "author/{namespace}" of Role "author" to '
        f'ServiceAccount "bob/{namespace}"'
    )


def test_rights_follow_each_binding_change_at_once(cluster, client, namespace):
    """The rules bound to a user are remembered between requests (a thousand runs' bindings
    were scanned on each): a binding made, a Role's rules changed or a binding removed
    answers the very next request."""
    accounts(client, namespace, "carol")
    rtype = cluster.registry.get("", "v1", "serviceaccounts")
    token = cluster._account_token(cluster.store.find(rtype, namespace, "carol"))
    coordination: Any = k8s.CoordinationV1Api(client)
    coordination.create_namespaced_lease(namespace, {"metadata": {"name": "mine"}, "spec": {}})
    mine = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/mine"
    assert request(cluster, "GET", mine, token).status == 403
    grant(client, namespace, "carols", "carol", LEASES)
    assert request(cluster, "GET", mine, token).status == 200
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    rbac.patch_namespaced_role("carols", namespace, {"rules": [{**LEASES, "verbs": ["update"]}]})
    assert request(cluster, "GET", mine, token).status == 403
    rbac.patch_namespaced_role("carols", namespace, {"rules": [LEASES]})
    assert request(cluster, "GET", mine, token).status == 200
    rbac.delete_namespaced_role_binding("carols", namespace)
    assert request(cluster, "GET", mine, token).status == 403

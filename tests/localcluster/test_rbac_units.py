"""The RBAC authorizer as pure functions: request attributes, rule kinds, bindings, the 403
text, impersonation and escalation coverage, each decided as kube-apiserver decides it."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import pytest

from rolloutrun_localcluster.access import uncovered
from rolloutrun_localcluster.errors import ApiError
from rolloutrun_localcluster.identity import ADMIN, Authenticator, impersonate
from rolloutrun_localcluster.rbac import (
    Attributes,
    UserInfo,
    authorize,
    forbidden,
    request_attributes,
    rule_allows,
    service_account_user,
)
from rolloutrun_localcluster.reviews import bootstrap_policy

Obj = dict[str, Any]
BOB = service_account_user("team", "bob")
ALICE = UserInfo("alice", ("devs", "system:authenticated"))


class Objects:
    """An in-memory policy: the bootstrap roles plus what a test adds."""

    def __init__(self, *extra: tuple[str, Obj]) -> None:
        self.items = [*bootstrap_policy(), *extra]

    def _of(self, plural: str) -> list[Obj]:
        return [obj for kind, obj in self.items if kind == plural]

    def role(self, namespace: str, name: str) -> Obj | None:
        found = [
            r
            for r in self._of("roles")
            if (r["metadata"]["namespace"], r["metadata"]["name"]) == (namespace, name)
        ]
        return found[0] if found else None

    def cluster_role(self, name: str) -> Obj | None:
        found = [r for r in self._of("clusterroles") if r["metadata"]["name"] == name]
        return found[0] if found else None

    def cluster_roles(self) -> Sequence[Obj]:
        return self._of("clusterroles")

    def cluster_role_bindings(self) -> Sequence[Obj]:
        return self._of("clusterrolebindings")

    def role_bindings(self, namespace: str) -> Sequence[Obj]:
        return [b for b in self._of("rolebindings") if b["metadata"]["namespace"] == namespace]


def role(name: str, namespace: str, *rules: Obj) -> tuple[str, Obj]:
    return "roles", {"metadata": {"name": name, "namespace": namespace}, "rules": list(rules)}


def binding(name: str, namespace: str, ref: tuple[str, str], *subjects: Obj) -> tuple[str, Obj]:
    body = {
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": ref[0], "name": ref[1]},
        "subjects": list(subjects),
    }
    return "rolebindings", body


def attrs(user: UserInfo, method: str, path: str, **query: str) -> Attributes:
    return request_attributes(user, method, path, query)


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/namespaces/a/pods/p", {}, ("get", "", "pods", "", "p", "a")),
        ("GET", "/api/v1/namespaces/a/pods", {}, ("list", "", "pods", "", "", "a")),
        ("GET", "/api/v1/pods", {"watch": "true"}, ("watch", "", "pods", "", "", "")),
        ("GET", "/api/v1/namespaces/a/pods/p/log", {}, ("get", "", "pods", "log", "p", "a")),
        ("POST", "/api/v1/namespaces/a/pods", {}, ("create", "", "pods", "", "", "a")),
        (
            "PUT",
            "/apis/coordination.k8s.io/v1/namespaces/a/leases/l",
            {},
            ("update", "coordination.k8s.io", "leases", "", "l", "a"),
        ),
        (
            "PATCH",
            "/apis/rolloutrun.dev/v1alpha1/namespaces/a/rolloutruns/r/status",
            {},
            ("patch", "rolloutrun.dev", "rolloutruns", "status", "r", "a"),
        ),
        ("DELETE", "/api/v1/namespaces/a/pods", {}, ("deletecollection", "", "pods", "", "", "a")),
        ("DELETE", "/api/v1/namespaces/a", {}, ("delete", "", "namespaces", "", "a", "a")),
        (
            "GET",
            "/api/v1/namespaces/a/leases",
            {"fieldSelector": "metadata.name=l"},
            ("list", "", "leases", "", "l", "a"),
        ),
        ("GET", "/api/v1/nodes/n", {}, ("get", "", "nodes", "", "n", "")),
    ],
)
def test_request_attributes_are_derived_from_method_and_path(method, path, query, expected):
    got = request_attributes(BOB, method, path, query)
    assert got.resource_request
    assert (got.verb, got.api_group, got.resource, got.subresource, got.name, got.namespace) == (
        expected
    )


@pytest.mark.parametrize("path", ["/healthz", "/version", "/api", "/apis", "/apis/apps/v1"])
def test_discovery_paths_are_non_resource_urls(path):
    got = request_attributes(BOB, "GET", path, {})
    assert not got.resource_request and got.verb == "get" and got.path == path


def test_rule_kinds_verbs_groups_resources_names_subresources():
    rule = {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["mine"],
        "verbs": ["get", "update"],
    }
    lease = "/apis/coordination.k8s.io/v1/namespaces/a/leases"
    assert rule_allows(attrs(BOB, "GET", f"{lease}/mine"), rule)
    assert rule_allows(attrs(BOB, "PUT", f"{lease}/mine"), rule)
    assert not rule_allows(attrs(BOB, "PATCH", f"{lease}/mine"), rule)  # verb
    assert not rule_allows(attrs(BOB, "GET", f"{lease}/other"), rule)  # resourceNames
    assert not rule_allows(attrs(BOB, "GET", lease), rule)  # a list has no name
    assert not rule_allows(attrs(BOB, "POST", lease), rule)  # create cannot name the object
    assert not rule_allows(attrs(BOB, "GET", "/api/v1/namespaces/a/leases/mine"), rule)  # group
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}
    assert rule_allows(attrs(BOB, "DELETE", "/api/v1/namespaces/a/pods"), pods)
    assert not rule_allows(attrs(BOB, "GET", "/api/v1/namespaces/a/pods/p/log"), pods)
    logs = {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}
    assert rule_allows(attrs(BOB, "GET", "/api/v1/namespaces/a/pods/p/log"), logs)
    assert not rule_allows(attrs(BOB, "GET", "/api/v1/namespaces/a/pods/p"), logs)
    scale = {"apiGroups": ["*"], "resources": ["*/scale"], "verbs": ["get"]}
    assert rule_allows(attrs(BOB, "GET", "/apis/apps/v1/namespaces/a/deployments/d/scale"), scale)
    assert not rule_allows(attrs(BOB, "GET", "/apis/apps/v1/namespaces/a/deployments/d"), scale)
    every = {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}
    assert rule_allows(attrs(BOB, "POST", "/api/v1/namespaces/a/pods/p/eviction"), every)


def test_non_resource_urls_exact_and_prefix():
    rule = {"nonResourceURLs": ["/healthz", "/apis/*"], "verbs": ["get"]}
    assert rule_allows(attrs(BOB, "GET", "/healthz"), rule)
    assert rule_allows(attrs(BOB, "GET", "/apis/rolloutrun.dev/v1alpha1"), rule)
    assert not rule_allows(attrs(BOB, "GET", "/healthz/etcd"), rule)
    assert not rule_allows(attrs(BOB, "POST", "/healthz"), rule)


def test_bindings_scope_roles_and_subjects():
    lease_rule = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}
    objects = Objects(
        role("leases", "team", lease_rule),
        binding("bob", "team", ("Role", "leases"), {"kind": "ServiceAccount", "name": "bob"}),
        binding(
            "devs", "other", ("ClusterRole", "system:basic-user"), {"kind": "Group", "name": "devs"}
        ),
    )
    lease = "/apis/coordination.k8s.io/v1/namespaces/{}/leases/l"
    assert authorize(attrs(BOB, "GET", lease.format("team")), objects).allowed
    denied = authorize(attrs(BOB, "GET", lease.format("elsewhere")), objects)
    assert not denied.allowed and denied.reason == ""
    other = service_account_user("elsewhere", "bob")  # same name, other namespace
    assert not authorize(attrs(other, "GET", lease.format("team")), objects).allowed
    allowed = authorize(attrs(BOB, "GET", lease.format("team")), objects)
    assert allowed.reason == (
        'RBAC: allowed by RoleBinding "bob/team" of Role "leases" to ServiceAccount "bob/team"'
    )
    # every authenticated user discovers the API; nobody else without a binding
    assert authorize(attrs(BOB, "GET", "/apis"), objects).allowed
    assert authorize(attrs(ALICE, "GET", "/openapi/v3"), objects).allowed
    assert not authorize(attrs(ALICE, "GET", "/metrics"), objects).allowed
    assert not authorize(attrs(ALICE, "GET", "/api/v1/namespaces/other/pods"), objects).allowed
    assert authorize(attrs(ADMIN, "DELETE", "/api/v1/nodes/n"), objects).allowed


def test_a_binding_to_a_missing_role_is_the_reason_of_the_denial():
    objects = Objects(
        binding("bob", "team", ("Role", "gone"), {"kind": "ServiceAccount", "name": "bob"})
    )
    denied = authorize(attrs(BOB, "GET", "/api/v1/namespaces/team/pods"), objects)
    assert not denied.allowed
    assert denied.reason == 'RBAC: role.rbac.authorization.k8s.io "gone" not found'


def test_aggregated_cluster_roles_take_the_rules_their_selectors_match():
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}
    objects = Objects(
        (
            "clusterroles",
            {
                "metadata": {"name": "view"},
                "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"agg": "view"}}]},
            },
        ),
        (
            "clusterroles",
            {"metadata": {"name": "pods", "labels": {"agg": "view"}}, "rules": [pods]},
        ),
        binding("bob", "team", ("ClusterRole", "view"), {"kind": "User", "name": BOB.name}),
    )
    assert authorize(attrs(BOB, "GET", "/api/v1/namespaces/team/pods"), objects).allowed
    assert not authorize(attrs(BOB, "GET", "/api/v1/namespaces/other/pods"), objects).allowed


def test_the_forbidden_status_is_the_real_one():
    error = forbidden(attrs(BOB, "GET", "/api/v1/namespaces/team/pods/p/log"))
    assert error.code == 403 and error.reason == "Forbidden"
    assert error.message == (
        'pods "p" is forbidden: User "system:serviceaccount:team:bob" cannot get resource '
        '"pods/log" in API group "" in the namespace "team"'
    )
    assert error.status()["details"] == {"name": "p", "kind": "pods"}
    nodes = forbidden(attrs(BOB, "GET", "/api/v1/nodes"))
    assert nodes.message == (
        'nodes is forbidden: User "system:serviceaccount:team:bob" cannot list resource '
        '"nodes" in API group "" at the cluster scope'
    )
    leases = forbidden(attrs(BOB, "POST", "/apis/coordination.k8s.io/v1/namespaces/t/leases"))
    assert leases.message.startswith("leases.coordination.k8s.io is forbidden: ")
    assert leases.status()["details"] == {"group": "coordination.k8s.io", "kind": "leases"}
    path = forbidden(attrs(BOB, "GET", "/metrics"))
    assert (
        path.message
        == 'forbidden: User "system:serviceaccount:team:bob" cannot get path "/metrics"'
    )


def test_impersonation_needs_the_impersonate_verb_and_fills_groups():
    objects = Objects()

    def check(a: Attributes) -> Any:
        return authorize(a, objects)

    acting = impersonate(ADMIN, {"Impersonate-User": BOB.name}, [], check)
    assert acting == UserInfo(BOB.name, BOB.groups)
    as_group = impersonate(ADMIN, {"Impersonate-User": "carol"}, ["devs"], check)
    assert as_group.groups == ("devs", "system:authenticated")
    with pytest.raises(ApiError) as refused:
        impersonate(ALICE, {"Impersonate-User": BOB.name}, [], check)
    assert refused.value.code == 403
    assert refused.value.message == (
        'serviceaccounts "bob" is forbidden: User "alice" cannot impersonate resource '
        '"serviceaccounts" in API group "" in the namespace "team"'
    )
    with pytest.raises(ApiError):
        impersonate(ALICE, {"Impersonate-User": "alice"}, ["system:masters"], check)


def test_tokens_name_their_account_and_die_with_it():
    accounts = {("team", "bob"): {"metadata": {"namespace": "team", "name": "bob", "uid": "u1"}}}
    now = [1000.0]
    authn = Authenticator("admin-token", lambda ns, n: accounts.get((ns, n)), clock=lambda: now[0])
    token, _ = authn.issue(accounts[("team", "bob")])
    assert authn.authenticate(f"Bearer {token}").name == BOB.name
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["sub"] == "system:serviceaccount:team:bob"  # as a real token names it
    assert authn.authenticate("Bearer admin-token") == ADMIN
    for wrong in (f"Bearer {token}x", f"Bearer {token[:-2]}", "Bearer a.b.c", "Basic x"):
        with pytest.raises(ApiError) as error:
            authn.authenticate(wrong)
        assert error.value.code == 401
    expiring, expires = authn.issue(accounts[("team", "bob")], 600)
    assert expires == 1600
    now[0] = 1601.0
    with pytest.raises(ApiError):
        authn.authenticate(f"Bearer {expiring}")
    accounts[("team", "bob")] = {"metadata": {"namespace": "team", "name": "bob", "uid": "u2"}}
    with pytest.raises(ApiError):  # deleted and made again: another uid, the old token is dead
        authn.authenticate(f"Bearer {token}")


def test_escalation_coverage_lists_what_is_not_held():
    held = [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    ]
    member = {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["run-trainer"],
        "verbs": ["get", "update", "patch"],
    }
    assert uncovered(held, [member]) == [
        '{APIGroups:["coordination.k8s.io"], Resources:["leases"], '
        'ResourceNames:["run-trainer"], Verbs:["patch"]}'
    ]
    assert uncovered(held, [{"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]) == []
    assert uncovered(held, [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]) == [
        '{APIGroups:[""], Resources:["pods"], Verbs:["get"]}'
    ]


def test_escalation_coverage_matches_wildcards_as_the_authorizer_does():
    """Coverage is the authorizer's own matching: ``*/sub`` resources, ``prefix*`` URLs,
    resourceNames that narrow, and URL rules that cover no resource."""
    held = [
        {"apiGroups": [""], "resources": ["*/log"], "verbs": ["get"]},
        {"apiGroups": ["*"], "resources": ["leases"], "resourceNames": ["mine"], "verbs": ["*"]},
        {"nonResourceURLs": ["/logs/*"], "verbs": ["get"]},
    ]
    covered = [
        {"apiGroups": [""], "resources": ["pods/log", "nodes/log"], "verbs": ["get"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["mine"],
            "verbs": ["delete"],
        },
        {"nonResourceURLs": ["/logs/kubelet"], "verbs": ["get"]},
    ]
    assert uncovered(held, covered) == []
    wanted = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]},
        {"nonResourceURLs": ["/logs", "/metrics"], "verbs": ["get", "post"]},
    ]
    assert uncovered(held, wanted) == [
        '{APIGroups:[""], Resources:["pods"], Verbs:["get"]}',
        '{APIGroups:["coordination.k8s.io"], Resources:["leases"], Verbs:["get"]}',
        '{NonResourceURLs:["/logs"], Verbs:["get" "post"]}',
        '{NonResourceURLs:["/metrics"], Verbs:["get" "post"]}',
    ]

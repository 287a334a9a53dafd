"""The operator's own identity on the local cluster: a ServiceAccount, a ClusterRole, a
binding and a kubeconfig with that account's token.

Why: run as the admin, the operator could use any verb, and a permission missing from the
chart would only show on a real cluster. ``rolloutrun run`` and the tests that start the
operator give it exactly the rules the chart grants (``rolloutrun_operator.kube.
permission_rules``, the list the chart is tested against), so a request outside them is a
403 here as it is on GKE. The user's kubeconfig keeps the admin identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import kubeconfig
from .cluster import LocalCluster
from .rbac import RBAC_GROUP

Obj = dict[str, Any]
NAMESPACE = "rolloutrun-system"
ACCOUNT = "rolloutrun-operator"


def manifests(rules: list[Obj], name: str, namespace: str) -> list[tuple[str, str, Obj]]:
    """``(group, plural, object)`` of the account, its ClusterRole and the binding."""
    labels = {"app.kubernetes.io/name": "rolloutrun-operator"}
    return [
        ("", "namespaces", {"metadata": {"name": namespace}}),
        ("", "serviceaccounts", {"metadata": {"name": name, "namespace": namespace}}),
        (
            RBAC_GROUP,
            "clusterroles",
            {"metadata": {"name": name, "labels": labels}, "rules": rules},
        ),
        (
            RBAC_GROUP,
            "clusterrolebindings",
            {
                "metadata": {"name": name, "labels": labels},
                "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
            },
        ),
    ]


def operator_kubeconfig(
    cluster: LocalCluster, rules: list[Obj], name: str = ACCOUNT, namespace: str = NAMESPACE
) -> Path:
    """Create (or replace the rules of) the operator's account, ClusterRole and binding;
    return a kubeconfig (0600) that authenticates as that account."""

    def apply() -> str:
        store, registry, server = cluster.store, cluster.registry, cluster.server
        assert server is not None
        for group, plural, obj in manifests(rules, name, namespace):
            rtype = registry.get(group, "v1", plural)
            assert rtype is not None
            meta = obj["metadata"]
            existing = store.find(rtype, meta.get("namespace", ""), meta["name"])
            if existing is None:
                store.create(rtype, meta.get("namespace", ""), obj)
            elif plural == "clusterroles":
                store.update(rtype, "", meta["name"], {**existing, "rules": rules})
        account = registry.get("", "v1", "serviceaccounts")
        assert account is not None
        found = store.find(account, namespace, name)
        assert found is not None
        return server.access.authenticator.issue(found)[0]

    token = cluster.call(apply)
    path = cluster.directory / f"{name}.kubeconfig"
    return kubeconfig.write(path, cluster.api_url, token, cluster.ca_path.read_bytes(), namespace)

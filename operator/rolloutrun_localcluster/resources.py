"""The resource types the emulator serves, and the discovery documents that describe them.

Clients never hard-code URLs of custom resources: Kopf, kubectl and the dynamic client read
``/api``, ``/apis`` and the group-version resource lists first. The registry therefore holds
the built-in kinds the operator needs plus one entry per served version of every
CustomResourceDefinition, updated the moment a CRD is written (the real server takes a
moment to establish a CRD; here it is immediate, with ``Established=True`` in its status).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ResourceType:
    """One resource (``pods``, ``rolloutruns.rolloutrun.dev``) as the API serves it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = (
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    )
    custom: bool = False
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    printer_columns: tuple[dict[str, Any], ...] = field(default=(), compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> str:
        """Objects of all versions of one resource share storage (no conversion needed)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources


def _core(
    plural: str, kind: str, namespaced: bool, short: tuple[str, ...] = (), sub: tuple[str, ...] = ()
) -> ResourceType:
    return ResourceType("", "v1", plural, kind, namespaced, kind.lower(), short, sub)


BUILTINS: tuple[ResourceType, ...] = (
    _core("namespaces", "Namespace", False, ("ns",), ("status",)),
    _core("nodes", "Node", False, ("no",), ("status",)),
    _core("pods", "Pod", True, ("po",), ("status", "log", "eviction")),
    _core("services", "Service", True, ("svc",), ("status",)),
    _core("endpoints", "Endpoints", True, ("ep",)),
    _core("configmaps", "ConfigMap", True, ("cm",)),
    _core("secrets", "Secret", True),
    _core("serviceaccounts", "ServiceAccount", True, ("sa",), ("token",)),
    _core("events", "Event", True, ("ev",)),
    _core("resourcequotas", "ResourceQuota", True, ("quota",), ("status",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True, "lease"),
    # Claims bound by the local-dir provisioner (storage_provisioner.py).
    _core("persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), ("status",)),
    _core("persistentvolumes", "PersistentVolume", False, ("pv",), ("status",)),
    ResourceType(
        "storage.k8s.io", "v1", "storageclasses", "StorageClass", False, "storageclass", ("sc",)
    ),
    # Enforced by the authorizer (rbac.py) on every request.
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", True, "role"),
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True, "rolebinding"
    ),
    # Cluster-wide RBAC (enforced: rbac.py) and Deployments (stored for the chart, not run).
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False, "clusterrole"
    ),
    ResourceType(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        False,
        "clusterrolebinding",
    ),
    ResourceType(
        "apps", "v1", "deployments", "Deployment", True, "deployment", ("deploy",), ("status",)
    ),
    # Computed, never stored (reviews.py): access reviews and "who am I".
    *(
        ResourceType(group, "v1", plural, kind, namespaced, kind.lower(), verbs=("create",))
        for group, plural, kind, namespaced in (
            ("authorization.k8s.io", "selfsubjectaccessreviews", "SelfSubjectAccessReview", False),
            ("authorization.k8s.io", "selfsubjectrulesreviews", "SelfSubjectRulesReview", False),
            ("authorization.k8s.io", "subjectaccessreviews", "SubjectAccessReview", False),
            (
                "authorization.k8s.io",
                "localsubjectaccessreviews",
                "LocalSubjectAccessReview",
                True,
            ),
            ("authentication.k8s.io", "selfsubjectreviews", "SelfSubjectReview", False),
        )
    ),
    # Status computed by the disruption controller, honoured by pods/eviction (disruption.py).
    ResourceType(
        "policy",
        "v1",
        "poddisruptionbudgets",
        "PodDisruptionBudget",
        True,
        "poddisruptionbudget",
        ("pdb",),
        ("status",),
    ),
    # Stored, not enforced: pods of the local cluster share the host's network (issue 13).
    ResourceType(
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        "NetworkPolicy",
        True,
        "networkpolicy",
        ("netpol",),
    ),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        "customresourcedefinition",
        ("crd", "crds"),
        ("status",),
    ),
)


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """The served versions of a CRD as resource types."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    result = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = tuple(sorted((version.get("subresources") or {}).keys()))
        result.append(
            ResourceType(
                group=spec.get("group", ""),
                version=version["name"],
                plural=names.get("plural", ""),
                kind=names.get("kind", ""),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular") or names.get("kind", "").lower(),
                short_names=tuple(names.get("shortNames") or ()),
                subresources=subresources,
                categories=tuple(names.get("categories") or ()),
                custom=True,
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
            )
        )
    return result


class Registry:
    """Built-in and CRD-defined resource types, looked up by group, version and plural."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._by_crd: dict[str, list[ResourceType]] = {}
        for rtype in BUILTINS:
            self._types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def by_storage_key(self, key: str) -> list[ResourceType]:
        return [t for t in self._types.values() if t.storage_key == key]

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def put_crd(self, crd: dict[str, Any]) -> None:
        name = crd["metadata"]["name"]
        self.remove_crd(name)
        types = types_from_crd(crd)
        self._by_crd[name] = types
        for rtype in types:
            self._types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def remove_crd(self, name: str) -> list[ResourceType]:
        types = self._by_crd.pop(name, [])
        for rtype in types:
            self._types.pop((rtype.group, rtype.version, rtype.plural), None)
        return types

    def group_versions(self) -> dict[str, list[str]]:
        """Groups (without the core group) to their served versions, preferred first."""
        groups: dict[str, list[str]] = {}
        for group, version, _ in self._types:
            if group and version not in groups.setdefault(group, []):
                groups[group].append(version)
        for versions in groups.values():
            versions.sort(key=_version_priority)
        return dict(sorted(groups.items()))


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version ordering: GA before beta before alpha, higher numbers first."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (3, 0, 0)
    level = {"None": 0, "beta": 1, "alpha": 2}[str(match[2])]
    return (level, -int(match[1]), -int(match[3] or 0))


# A subresource whose kind lives in another group says so in discovery: ``kubectl drain``
# evicts only when ``pods/eviction`` names policy/v1 (without it, it deletes the pods).
SUBRESOURCE_GROUP_VERSIONS: dict[str, dict[str, str]] = {
    "eviction": {"group": "policy", "version": "v1"},
}
# The built-in kinds of the ``all`` category (``kubectl get all``) that the emulator serves.
BUILTIN_CATEGORIES: dict[str, tuple[str, ...]] = {
    "pods": ("all",),
    "services": ("all",),
    "deployments.apps": ("all",),
}


def resource_list(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    """``APIResourceList`` for ``/api/v1`` or ``/apis/<group>/<version>``."""
    types = [t for t in registry.all() if t.group == group and t.version == version]
    if not types:
        return None
    resources: list[dict[str, Any]] = []
    for rtype in sorted(types, key=lambda t: t.plural):
        entry: dict[str, Any] = {
            "name": rtype.plural,
            "singularName": rtype.singular,
            "namespaced": rtype.namespaced,
            "kind": rtype.kind,
            "verbs": list(rtype.verbs),
        }
        if rtype.short_names:
            entry["shortNames"] = list(rtype.short_names)
        categories = rtype.categories or BUILTIN_CATEGORIES.get(rtype.storage_key, ())
        if categories:
            entry["categories"] = list(categories)
        resources.append(entry)
        for sub in rtype.subresources:
            verbs = {"status": ["get", "patch", "update"], "log": ["get"]}.get(sub, ["create"])
            sub_kind = {
                "log": "Pod",
                "eviction": "Eviction",
                "binding": "Binding",
                "token": "TokenRequest",
            }.get(sub, rtype.kind)
            resources.append(
                {
                    "name": f"{rtype.plural}/{sub}",
                    "singularName": "",
                    "namespaced": rtype.namespaced,
                    **SUBRESOURCE_GROUP_VERSIONS.get(sub, {}),
                    "kind": sub_kind,
                    "verbs": verbs,
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def api_group(group: str, versions: list[str]) -> dict[str, Any]:
    entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": entries,
        "preferredVersion": entries[0],
    }


def api_group_list(registry: Registry) -> dict[str, Any]:
    groups = [api_group(g, vs) for g, vs in registry.group_versions().items()]
    for group in groups:
        del group["kind"], group["apiVersion"]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def core_versions(address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


VERSION_INFO: dict[str, str] = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-rolloutrun-localcluster",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}

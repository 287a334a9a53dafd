"""The RBAC authorizer, as pure functions over the RBAC objects of the store.

Why: the operator's and the trainer's rights were never enforced anywhere, so a permission
missing from the chart's ClusterRole or the run's member Role surfaced only on a real
cluster. This module decides every request the way kube-apiserver does:

- :func:`request_attributes` derives the attributes from the method and path alone, as the
  server's ``RequestInfoFactory`` does before any handler runs (GET on a name = get, on a
  collection = list, ``watch=true`` = watch, DELETE on a collection = deletecollection,
  a ``metadata.name`` field selector names the object, anything outside ``/api`` and
  ``/apis/<group>/<version>/...`` is a non-resource URL);
- :func:`authorize` grants when a rule of a role bound to the user allows the attributes
  (``system:masters`` is always allowed, as the real server's privileged-group authorizer);
  ClusterRoleBindings apply everywhere, RoleBindings in their namespace, non-resource URLs
  only through ClusterRoleBindings; aggregated ClusterRoles take the rules of the
  ClusterRoles their selectors match;
- :func:`forbidden` is the 403 ``Status`` with the real message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ApiError
from .selectors import labels_match, selector_from_label_selector

Obj = dict[str, Any]
Rule = Mapping[str, Any]

MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"
ANONYMOUS = "system:anonymous"
SA_PREFIX = "system:serviceaccount:"
RBAC_GROUP = "rbac.authorization.k8s.io"
#: Namespace subresources: ``/api/v1/namespaces/NS/status`` is the namespace's status.
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})
_VERBS = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}


@dataclass(frozen=True)
class UserInfo:
    """Who is asking: the authenticated (or impersonated) user."""

    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def service_account_user(namespace: str, name: str, uid: str = "") -> UserInfo:
    """The user a ServiceAccount token authenticates as."""
    groups = ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED)
    return UserInfo(f"{SA_PREFIX}{namespace}:{name}", groups, uid)


def split_service_account(username: str) -> tuple[str, str] | None:
    """``(namespace, name)`` of a ``system:serviceaccount:NS:NAME`` user, else None."""
    if not username.startswith(SA_PREFIX):
        return None
    parts = username[len(SA_PREFIX) :].split(":")
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]


@dataclass(frozen=True)
class Attributes:
    """What a request does, as the authorizer sees it."""

    user: UserInfo
    verb: str
    path: str = ""
    resource_request: bool = True
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    namespace: str = ""

    @property
    def combined_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def request_attributes(
    user: UserInfo, method: str, path: str, query: Mapping[str, str]
) -> Attributes:
    """The attributes of a request, from its method, path and query only (RequestInfo)."""
    parts = [part for part in path.split("/") if part]
    non_resource = Attributes(user, method.lower(), path, resource_request=False)
    if not parts or parts[0] not in ("api", "apis"):
        return non_resource
    if parts[0] == "apis":
        if len(parts) < 4:
            return non_resource
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        if len(parts) < 3:
            return non_resource
        group, version, rest = "", parts[1], parts[2:]
    verb = _VERBS.get(method.upper(), method.lower())
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("true", "1") else "list"
        name = _name_from_field_selector(query.get("fieldSelector") or "")
    if not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(
        user, verb, path, True, group, version, resource, subresource, name, namespace
    )


def _name_from_field_selector(selector: str) -> str:
    """The object a ``metadata.name=NAME`` (or ``==``) field selector names, else ""."""
    for clause in selector.split(","):
        key, sep, value = clause.partition("=")
        if sep and key.strip() == "metadata.name":
            return value.removeprefix("=").strip()
    return ""


# ---------------------------------------------------------------------------- rule matching
def _has(values: Iterable[str] | None, wanted: str) -> bool:
    values = list(values or ())
    return "*" in values or wanted in values


def resource_matches(rule: Rule, combined: str, subresource: str) -> bool:
    """``*``, the exact ``resource[/subresource]``, or ``*/subresource``."""
    for ruled in rule.get("resources") or ():
        if ruled in ("*", combined):
            return True
        if subresource and ruled == f"*/{subresource}":
            return True
    return False


def url_matches(rule: Rule, path: str) -> bool:
    for ruled in rule.get("nonResourceURLs") or ():
        if ruled == "*" or ruled == path or (ruled.endswith("*") and path.startswith(ruled[:-1])):
            return True
    return False


def rule_allows(attributes: Attributes, rule: Rule) -> bool:
    """Whether one PolicyRule allows the request (the real ``RuleAllows``)."""
    if not _has(rule.get("verbs"), attributes.verb):
        return False
    if not attributes.resource_request:
        return url_matches(rule, attributes.path)
    names = rule.get("resourceNames") or ()
    return (
        _has(rule.get("apiGroups"), attributes.api_group)
        and resource_matches(rule, attributes.combined_resource, attributes.subresource)
        and (not names or attributes.name in names)
    )


# ---------------------------------------------------------------------------- the policy
class RbacObjects(Protocol):
    """Where the authorizer reads Roles, ClusterRoles and their bindings."""

    def role(self, namespace: str, name: str) -> Obj | None: ...

    def cluster_role(self, name: str) -> Obj | None: ...

    def cluster_roles(self) -> Sequence[Obj]: ...

    def cluster_role_bindings(self) -> Sequence[Obj]: ...

    def role_bindings(self, namespace: str) -> Sequence[Obj]: ...


def applies_to(user: UserInfo, subject: Mapping[str, Any], namespace: str) -> bool:
    """Whether a binding's subject is this user (a ServiceAccount subject without a
    namespace means the binding's own)."""
    kind, name = subject.get("kind"), subject.get("name", "")
    if kind == "User":
        return user.name == name
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        account_namespace = subject.get("namespace") or namespace
        return bool(account_namespace) and user.name == f"{SA_PREFIX}{account_namespace}:{name}"
    return False


def cluster_role_rules(objects: RbacObjects, role: Obj) -> list[Rule]:
    """A ClusterRole's rules, with those of the ClusterRoles its aggregation rule selects."""
    rules: list[Rule] = list(role.get("rules") or ())
    aggregation = role.get("aggregationRule") or {}
    for selector in aggregation.get("clusterRoleSelectors") or ():
        requirements = selector_from_label_selector(selector)
        if requirements is None:
            continue
        for other in objects.cluster_roles():
            if other is role or other.get("aggregationRule"):
                continue
            if labels_match(requirements, (other.get("metadata") or {}).get("labels")):
                rules.extend(other.get("rules") or ())
    return rules


@dataclass(frozen=True)
class Grant:
    """Rules of one role reached through one binding, for ``reason`` texts."""

    binding: str
    role: str
    subject: str
    rules: tuple[Rule, ...]


def _role_of(objects: RbacObjects, binding: Obj, namespace: str) -> tuple[str, Obj | None]:
    ref = binding.get("roleRef") or {}
    kind, name = ref.get("kind", ""), ref.get("name", "")
    if kind == "ClusterRole":
        return f'ClusterRole "{name}"', objects.cluster_role(name)
    if kind == "Role" and namespace:
        return f'Role "{name}"', objects.role(namespace, name)
    return f'{kind} "{name}"', None


def grants(objects: RbacObjects, user: UserInfo, namespace: str) -> tuple[list[Grant], list[str]]:
    """The rules bound to ``user`` that apply in ``namespace`` ("" = cluster scope), and the
    errors met (a binding to a role that does not exist), as the real rule resolver."""
    found: list[Grant] = []
    problems: list[str] = []
    scopes: list[tuple[str, str, Sequence[Obj]]] = [
        ("ClusterRoleBinding", "", objects.cluster_role_bindings())
    ]
    if namespace:
        scopes.append(("RoleBinding", namespace, objects.role_bindings(namespace)))
    for kind, scope, bindings in scopes:
        for binding in bindings:
            subjects = [s for s in binding.get("subjects") or () if applies_to(user, s, scope)]
            if not subjects:
                continue
            role_text, role = _role_of(objects, binding, scope)
            meta = binding.get("metadata") or {}
            where = f"/{meta.get('namespace')}" if scope else ""
            if role is None:
                ref = binding.get("roleRef") or {}
                plural = "clusterrole" if ref.get("kind") == "ClusterRole" else "role"
                problems.append(f'{plural}.{RBAC_GROUP} "{ref.get("name", "")}" not found')
                continue
            if (binding.get("roleRef") or {}).get("kind") == "ClusterRole":
                rules = cluster_role_rules(objects, role)
            else:
                rules = list(role.get("rules") or ())
            label = f'{kind} "{meta.get("name", "")}{where}"'
            found.append(Grant(label, role_text, _describe(subjects[0], scope), tuple(rules)))
    return found, problems


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


def authorize(
    attributes: Attributes,
    objects: RbacObjects,
    resolve: Callable[[RbacObjects, UserInfo, str], tuple[list[Grant], list[str]]] | None = None,
) -> Decision:
    """Allow or deny, with the reason the real RBAC authorizer gives (``resolve``: how the
    rules bound to the user are found, :func:`grants` unless given)."""
    user = attributes.user
    if MASTERS in user.groups:
        return Decision(True, "")
    namespace = attributes.namespace if attributes.resource_request else ""
    found, problems = (resolve or grants)(objects, user, namespace)
    for grant in found:
        if not attributes.resource_request and grant.binding.startswith("RoleBinding"):
            continue  # non-resource URLs are granted cluster-wide only
        if any(rule_allows(attributes, rule) for rule in grant.rules):
            text = f"RBAC: allowed by {grant.binding} of {grant.role} to {grant.subject}"
            return Decision(True, text)
    if not problems:
        return Decision(False, "")
    joined = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
    return Decision(False, f"RBAC: {joined}")


def _describe(subject: Mapping[str, Any], namespace: str) -> str:
    """A subject as the real reason text names it (``ServiceAccount "name/namespace"``)."""
    kind, name = subject.get("kind", ""), subject.get("name", "")
    if kind == "ServiceAccount":
        return f'{kind} "{name}/{subject.get("namespace") or namespace}"'
    return f'{kind} "{name}"'


def forbidden(attributes: Attributes, reason: str = "") -> ApiError:
    """The 403 the real server answers (``responsewriters.Forbidden``)."""
    user = attributes.user.name
    if not attributes.resource_request:
        message = f'User "{user}" cannot {attributes.verb} path "{attributes.path}"'
        text = f"forbidden: {message}"
        details: dict[str, Any] = {}
    else:
        resource = attributes.combined_resource
        where = (
            f'in the namespace "{attributes.namespace}"'
            if attributes.namespace
            else "at the cluster scope"
        )
        message = (
            f'User "{user}" cannot {attributes.verb} resource "{resource}" in API group '
            f'"{attributes.api_group}" {where}'
        )
        qualified = (
            f"{attributes.resource}.{attributes.api_group}"
            if attributes.api_group
            else attributes.resource
        )
        subject = f'{qualified} "{attributes.name}"' if attributes.name else qualified
        text = f"{subject} is forbidden: {message}"
        details = {"kind": attributes.resource}
        if attributes.api_group:
            details["group"] = attributes.api_group
        if attributes.name:
            details["name"] = attributes.name
    if reason:
        text = f"{text}: {reason}"
    return ApiError(403, "Forbidden", text, details)

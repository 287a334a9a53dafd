"""Admission of each request: authenticate, impersonate, authorize, prevent escalation.

Why a module of its own: the HTTP face (:mod:`.server`) calls :meth:`Access.admit` once per
request, in its middleware, before any handler (as the real server's filter chain does),
and lets :meth:`Access.answer` reply to the computed creates (access reviews, TokenRequests).
The decisions themselves are the pure functions of :mod:`.rbac` and :mod:`.identity`.

Escalation prevention is the RBAC registry's rule: creating or updating a Role or
ClusterRole needs every rule it grants to be held by the caller (or the ``escalate`` verb);
a binding needs the rules of the role it binds (or the ``bind`` verb). It is checked on
create (POST) and update (PUT); patches of RBAC objects are not checked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from . import errors
from .errors import ApiError
from .identity import Authenticator, impersonate
from .rbac import (
    ANONYMOUS,
    MASTERS,
    RBAC_GROUP,
    Attributes,
    Decision,
    Grant,
    RbacObjects,
    Rule,
    UserInfo,
    authorize,
    forbidden,
    grants,
    request_attributes,
    rule_allows,
)
from .resources import Registry, ResourceType
from .reviews import COMPUTED, Reviews, bootstrap_policy
from .store import Event, Store

logger = logging.getLogger(__name__)
Obj = dict[str, Any]
_RBAC_KINDS = ("roles", "clusterroles", "rolebindings", "clusterrolebindings")


def bootstrap(store: Store, registry: Registry) -> None:
    """Create the default ClusterRoles and bindings that are missing (cluster start)."""
    for plural, obj in bootstrap_policy():
        rtype = registry.get(RBAC_GROUP, "v1", plural)
        assert rtype is not None
        if store.find(rtype, "", obj["metadata"]["name"]) is None:
            store.create(rtype, "", obj)


class StoreRbac:
    """The RBAC objects of the store, as :class:`.rbac.RbacObjects`."""

    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        # The rules bound to a user in a namespace, until any RBAC object changes: RBAC
        # looked at every RoleBinding of the namespace on every request (a thousand runs
        # bring a thousand), while bindings change only when runs come and go.
        self._grants: dict[tuple[str, tuple[str, ...], str], tuple[list[Grant], list[str]]] = {}
        store.subscribe(self._forget_grants)

    def _forget_grants(self, event: Event) -> None:
        if event.storage_key in {self._type(plural).storage_key for plural in _RBAC_KINDS}:
            self._grants.clear()

    def grants(
        self, objects: RbacObjects, user: UserInfo, namespace: str
    ) -> tuple[list[Grant], list[str]]:
        """:func:`.rbac.grants`, remembered until an RBAC object changes."""
        key = (user.name, user.groups, namespace)
        found = self._grants.get(key)
        if found is None:
            if len(self._grants) > 10_000:
                self._grants.clear()
            found = self._grants[key] = grants(objects, user, namespace)
        return found

    def _type(self, plural: str) -> ResourceType:
        rtype = self.registry.get(RBAC_GROUP, "v1", plural)
        assert rtype is not None, plural
        return rtype

    def role(self, namespace: str, name: str) -> Obj | None:
        return self.store.find(self._type("roles"), namespace, name)

    def cluster_role(self, name: str) -> Obj | None:
        return self.store.find(self._type("clusterroles"), "", name)

    def cluster_roles(self) -> Sequence[Obj]:
        return list(self.store.objects(self._type("clusterroles").storage_key))

    def cluster_role_bindings(self) -> Sequence[Obj]:
        return list(self.store.objects(self._type("clusterrolebindings").storage_key))

    def role_bindings(self, namespace: str) -> Sequence[Obj]:
        key = self._type("rolebindings").storage_key
        return self.store.objects_in(key, namespace)


class Access:
    """Authentication, impersonation and authorization of the API server's requests."""

    def __init__(self, store: Store, registry: Registry, admin_token: str) -> None:
        self.store = store
        self.registry = registry
        self.objects = StoreRbac(store, registry)
        self.authenticator = Authenticator(admin_token, self.account)
        self.reviews = Reviews(self.objects, self.check, self.authenticator, self.account)

    def account(self, namespace: str, name: str) -> Obj | None:
        rtype = self.registry.get("", "v1", "serviceaccounts")
        assert rtype is not None
        return self.store.find(rtype, namespace, name)

    def check(self, attributes: Attributes) -> Decision:
        return authorize(attributes, self.objects, self.objects.grants)

    def admit(
        self,
        method: str,
        path: str,
        query: Mapping[str, str],
        headers: Mapping[str, str],
        groups: list[str],
    ) -> Attributes:
        """The authorized request's attributes; 401 for an unknown token (or an anonymous
        caller the policy does not allow), 403 ``Status`` when RBAC denies."""
        caller = self.authenticator.authenticate(headers.get("Authorization"))
        user = impersonate(caller, headers, groups, self.check)
        attributes = request_attributes(user, method, path.rstrip("/") or "/", query)
        decision = self.check(attributes)
        if not decision.allowed:
            logger.debug("RBAC denied %s", attributes)
            if caller.name == ANONYMOUS:
                raise errors.unauthorized()
            raise forbidden(attributes, decision.reason)
        return attributes

    def computed(self, attributes: Attributes) -> bool:
        """Whether the request is a create answered here rather than stored."""
        key = (attributes.api_group, attributes.resource, attributes.subresource)
        return attributes.verb == "create" and key in COMPUTED

    def answer(self, attributes: Attributes, body: Any) -> tuple[Obj, int]:
        """The response of a computed create; ``body`` is the request's, decoded by the server
        from whatever encoding kubectl chose (None when empty: an empty object)."""
        return self.reviews.answer(attributes, {} if body is None else body)

    def check_escalation(self, attributes: Attributes, body: Any) -> None:
        """403 when a create/update of an RBAC object grants what the caller does not hold."""
        if (
            attributes.api_group != RBAC_GROUP
            or attributes.resource not in _RBAC_KINDS
            or attributes.subresource
            or attributes.verb not in ("create", "update")
            or not isinstance(body, dict)
            or MASTERS in attributes.user.groups
        ):
            return
        wanted = self._granted_by(attributes, body)
        if wanted is None:
            return
        found, _ = grants(self.objects, attributes.user, attributes.namespace)
        held = [rule for grant in found for rule in grant.rules]
        missing = uncovered(held, wanted)
        if missing:
            user = attributes.user
            groups = " ".join(f'"{g}"' for g in user.groups)
            name = (body.get("metadata") or {}).get("name") or attributes.name
            raise ApiError(
                403,
                "Forbidden",
                f'{attributes.resource}.{RBAC_GROUP} "{name}" is forbidden: user "{user.name}" '
                f"(groups=[{groups}]) is attempting to grant RBAC permissions not currently "
                "held:\n" + "\n".join(missing),
                {"name": name, "group": RBAC_GROUP, "kind": attributes.resource},
            )

    def _granted_by(self, attributes: Attributes, body: Obj) -> list[Rule] | None:
        """The rules the object grants; None when the caller may escalate or bind anyway."""
        user = attributes.user
        if attributes.resource in ("roles", "clusterroles"):
            if self._may(user, "escalate", attributes.resource, "", attributes.namespace):
                return None
            return list(body.get("rules") or ())
        ref = body.get("roleRef") or {}
        plural = "clusterroles" if ref.get("kind") == "ClusterRole" else "roles"
        if self._may(user, "bind", plural, ref.get("name", ""), attributes.namespace):
            return None
        if plural == "roles":
            role = self.objects.role(attributes.namespace, ref.get("name", ""))
            return None if role is None else list(role.get("rules") or ())
        role = self.objects.cluster_role(ref.get("name", ""))
        return None if role is None else list(role.get("rules") or ())

    def _may(self, user: UserInfo, verb: str, plural: str, name: str, namespace: str) -> bool:
        attributes = Attributes(
            user,
            verb,
            api_group=RBAC_GROUP,
            api_version="v1",
            resource=plural,
            name=name,
            namespace=namespace,
        )
        return self.check(attributes).allowed


# ---------------------------------------------------------------------------- coverage
# A held rule covers a granted one when it allows each single verb on each resource (or URL)
# the granted rule names, as a request: the real ``ruleCovers`` matches as ``RuleAllows``.
_NOBODY = UserInfo("")  # who asks is no matter
_Key = tuple[str, str, str, str]


def _asked(rule: Rule) -> Iterator[tuple[_Key, str, Attributes]]:
    """``(key, verb, request)`` for each single verb on one URL or resource(/name) of ``rule``."""
    for verb in rule.get("verbs") or ():
        for url in rule.get("nonResourceURLs") or ():
            yield ("url", url, "", ""), verb, Attributes(_NOBODY, verb, url, resource_request=False)
        for group in rule.get("apiGroups") or ():
            for resource in rule.get("resources") or ():
                plural, _, sub = resource.partition("/")
                for name in rule.get("resourceNames") or [""]:
                    asked = Attributes(
                        _NOBODY, verb, api_group=group, resource=plural, subresource=sub, name=name
                    )
                    yield ("res", group, resource, name), verb, asked


def _quoted(values: Iterable[str]) -> str:
    return "[" + " ".join(f'"{v}"' for v in values) + "]"


def uncovered(owner: Sequence[Rule], wanted: Sequence[Rule]) -> list[str]:
    """The rules of ``wanted`` no rule of ``owner`` covers, broken down to single verbs,
    merged back per group/resource/name and written as the real server writes them."""
    missing: dict[_Key, list[str]] = {}
    for rule in wanted:
        for key, verb, asked in _asked(rule):
            if not any(rule_allows(asked, held) for held in owner):
                missing.setdefault(key, []).append(verb)
    lines = []
    for (kind, first, resource, name), verbs in missing.items():
        if kind == "url":
            lines.append(f"{{NonResourceURLs:{_quoted([first])}, Verbs:{_quoted(verbs)}}}")
            continue
        names = f", ResourceNames:{_quoted([name])}" if name else ""
        lines.append(
            f"{{APIGroups:{_quoted([first])}, Resources:{_quoted([resource])}{names}, "
            f"Verbs:{_quoted(verbs)}}}"
        )
    return sorted(lines)

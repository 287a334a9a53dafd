"""Answers the API server computes instead of storing: access reviews, "who am I", tokens;
and the bootstrap RBAC policy every real cluster ships.

Why: ``kubectl auth can-i … --as …`` (SelfSubjectAccessReview), ``kubectl auth can-i
--list`` (SelfSubjectRulesReview), ``kubectl auth whoami`` (SelfSubjectReview) and
``kubectl create token`` (TokenRequest) are how a user checks RBAC; they must answer as the
authorizer decides. The bootstrap ClusterRoles grant discovery, the access reviews and the
health URLs to every authenticated user, so a ServiceAccount with no Role of its own still
discovers the API, as on a real cluster.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from . import errors
from .identity import DEFAULT_EXPIRATION_S, MIN_EXPIRATION_S, Authenticator
from .rbac import (
    AUTHENTICATED,
    MASTERS,
    RBAC_GROUP,
    UNAUTHENTICATED,
    Attributes,
    Decision,
    RbacObjects,
    UserInfo,
    grants,
)
from .store import rfc3339

Obj = dict[str, Any]
AUTHZ = "authorization.k8s.io"
AUTHN = "authentication.k8s.io"
#: (group, resource, subresource) of the create requests answered here, not stored.
COMPUTED = frozenset(
    {
        (AUTHZ, "selfsubjectaccessreviews", ""),
        (AUTHZ, "subjectaccessreviews", ""),
        (AUTHZ, "localsubjectaccessreviews", ""),
        (AUTHZ, "selfsubjectrulesreviews", ""),
        (AUTHN, "selfsubjectreviews", ""),
        ("", "serviceaccounts", "token"),
    }
)


def _meta() -> Obj:
    return {"creationTimestamp": None}


def _attributes_of(user: UserInfo, spec: Obj, namespace: str | None = None) -> Attributes:
    resource = spec.get("resourceAttributes")
    other = spec.get("nonResourceAttributes")
    if (resource is None) == (other is None) or not isinstance(resource or other, dict):
        raise errors.unprocessable(
            'spec.resourceAttributes: Invalid value: "null": exactly one of '
            "nonResourceAttributes or resourceAttributes must be specified"
        )
    if not isinstance(resource, dict):
        url: Obj = other or {}
        return Attributes(user, url.get("verb", ""), url.get("path", ""), resource_request=False)
    return Attributes(
        user,
        resource.get("verb", ""),
        resource_request=True,
        api_group=resource.get("group", ""),
        api_version=resource.get("version", ""),
        resource=resource.get("resource", ""),
        subresource=resource.get("subresource", ""),
        name=resource.get("name", ""),
        namespace=resource.get("namespace", "") if namespace is None else namespace,
    )


def _review(body: Obj, kind: str, decision: Decision) -> Obj:
    status: Obj = {"allowed": decision.allowed}
    if decision.reason:
        status["reason"] = decision.reason
    return {
        "kind": kind,
        "apiVersion": f"{AUTHZ}/v1",
        "metadata": _meta(),
        "spec": body.get("spec") or {},
        "status": status,
    }


def _subject(spec: Obj) -> UserInfo:
    extra = {k: tuple(v) for k, v in (spec.get("extra") or {}).items()}
    return UserInfo(
        spec.get("user", ""), tuple(spec.get("groups") or ()), spec.get("uid", ""), extra
    )


def rules_review(objects: RbacObjects, user: UserInfo, namespace: str) -> Obj:
    """``SelfSubjectRulesReview.status``: the rules bound to the user in ``namespace``."""
    found, problems = grants(objects, user, namespace)
    resource_rules, url_rules = [], []
    for grant in found:
        for rule in grant.rules:
            if rule.get("nonResourceURLs"):
                if grant.binding.startswith("ClusterRoleBinding"):
                    url_rules.append(
                        {
                            "verbs": list(rule["verbs"]),
                            "nonResourceURLs": list(rule["nonResourceURLs"]),
                        }
                    )
                continue
            entry = {k: list(rule.get(k) or ()) for k in ("verbs", "apiGroups", "resources")}
            if rule.get("resourceNames"):
                entry["resourceNames"] = list(rule["resourceNames"])
            resource_rules.append(entry)
    status: Obj = {
        "resourceRules": resource_rules,
        "nonResourceRules": url_rules,
        "incomplete": bool(problems),
    }
    if problems:
        status["evaluationError"] = "; ".join(problems)
    return status


class Reviews:
    """Answers the create requests of :data:`COMPUTED` for an authorized caller."""

    def __init__(
        self,
        objects: RbacObjects,
        check: Callable[[Attributes], Decision],
        authenticator: Authenticator,
        account: Callable[[str, str], Obj | None],
    ) -> None:
        self.objects = objects
        self.check = check
        self.authenticator = authenticator
        self.account = account

    def answer(self, attributes: Attributes, body: Any) -> tuple[Obj, int]:
        """The response body and code of a computed create."""
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        user = attributes.user
        spec = body.get("spec") or {}
        resource = attributes.resource
        if resource == "selfsubjectaccessreviews":
            decision = self.check(_attributes_of(user, spec))
            return _review(body, "SelfSubjectAccessReview", decision), 201
        if resource == "subjectaccessreviews":
            decision = self.check(_attributes_of(_subject(spec), spec))
            return _review(body, "SubjectAccessReview", decision), 201
        if resource == "localsubjectaccessreviews":
            decision = self.check(_attributes_of(_subject(spec), spec, attributes.namespace))
            answer = _review(body, "LocalSubjectAccessReview", decision)
            answer["metadata"]["namespace"] = attributes.namespace
            return answer, 201
        if resource == "selfsubjectrulesreviews":
            namespace = spec.get("namespace") or ""
            return {
                "kind": "SelfSubjectRulesReview",
                "apiVersion": f"{AUTHZ}/v1",
                "metadata": _meta(),
                "spec": spec,
                "status": rules_review(self.objects, user, namespace),
            }, 201
        if resource == "selfsubjectreviews":
            info: Obj = {"username": user.name, "groups": list(user.groups)}
            if user.uid:
                info["uid"] = user.uid
            return {
                "kind": "SelfSubjectReview",
                "apiVersion": f"{AUTHN}/v1",
                "metadata": _meta(),
                "status": {"userInfo": info},
            }, 201
        return self._token(attributes, body), 201

    def _token(self, attributes: Attributes, body: Obj) -> Obj:
        account = self.account(attributes.namespace, attributes.name)
        if account is None:
            raise errors.not_found("serviceaccounts", "", attributes.name)
        spec = dict(body.get("spec") or {})
        seconds = int(spec.get("expirationSeconds") or DEFAULT_EXPIRATION_S)
        if seconds < MIN_EXPIRATION_S:
            raise errors.invalid(
                "TokenRequest",
                AUTHN,
                attributes.name,
                [
                    (
                        "FieldValueInvalid",
                        "spec.expirationSeconds",
                        "spec.expirationSeconds: Invalid value: "
                        f"{seconds}: may not specify a duration less than 10 minutes",
                    )
                ],
            )
        token, expires = self.authenticator.issue(account, seconds, spec.get("audiences"))
        assert expires is not None
        spec["expirationSeconds"] = seconds
        expires_at = dt.datetime.fromtimestamp(expires, dt.UTC)
        return {
            "kind": "TokenRequest",
            "apiVersion": f"{AUTHN}/v1",
            "metadata": {
                "name": attributes.name,
                "namespace": attributes.namespace,
                "creationTimestamp": None,
            },
            "spec": spec,
            "status": {"token": token, "expirationTimestamp": rfc3339(expires_at)},
        }


# ---------------------------------------------------------------------------- bootstrap
def _cluster_role(name: str, rules: list[Obj]) -> Obj:
    labels = {"kubernetes.io/bootstrapping": "rbac-defaults"}
    return {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRole",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"},
        },
        "rules": rules,
    }


def _binding(name: str, groups: list[str]) -> Obj:
    return {
        "apiVersion": f"{RBAC_GROUP}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": g} for g in groups],
    }


_HEALTH = ["/healthz", "/livez", "/readyz", "/version", "/version/"]


def bootstrap_policy() -> list[tuple[str, Obj]]:
    """``(plural, object)`` of the default ClusterRoles and bindings a real cluster has."""
    discovery = ["/api", "/api/*", "/apis", "/apis/*", "/openapi", "/openapi/*", *_HEALTH]
    basic = [
        {
            "apiGroups": [AUTHZ],
            "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
            "verbs": ["create"],
        },
        {"apiGroups": [AUTHN], "resources": ["selfsubjectreviews"], "verbs": ["create"]},
    ]
    admin = [
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
        {"nonResourceURLs": ["*"], "verbs": ["*"]},
    ]
    return [
        ("clusterroles", _cluster_role("cluster-admin", admin)),
        (
            "clusterroles",
            _cluster_role(
                "system:discovery", [{"nonResourceURLs": sorted(discovery), "verbs": ["get"]}]
            ),
        ),
        ("clusterroles", _cluster_role("system:basic-user", basic)),
        (
            "clusterroles",
            _cluster_role(
                "system:public-info-viewer", [{"nonResourceURLs": _HEALTH, "verbs": ["get"]}]
            ),
        ),
        ("clusterrolebindings", _binding("cluster-admin", [MASTERS])),
        ("clusterrolebindings", _binding("system:discovery", [AUTHENTICATED])),
        ("clusterrolebindings", _binding("system:basic-user", [AUTHENTICATED])),
        (
            "clusterrolebindings",
            _binding("system:public-info-viewer", [AUTHENTICATED, UNAUTHENTICATED]),
        ),
    ]

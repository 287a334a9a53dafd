"""Authentication: who a bearer token is, and whom an impersonating caller acts as.

Why: with one all-powerful token, no RBAC rule could ever be tested. Now the user's
kubeconfig holds the admin token (``system:admin`` in ``system:masters``) and every
ServiceAccount gets its own: a JWT signed with the cluster's key (HS256), naming the account
and its uid, so a token stops working once its account is deleted (a new account of the
same name has another uid). Tokens are compared in constant time. TokenRequests
(``kubectl create token``) get a token that also expires.

Impersonation follows the real filter: each ``Impersonate-*`` header needs the
``impersonate`` verb on ``users``/``serviceaccounts``/``groups``/``uids``; an impersonated
ServiceAccount without groups gets its account groups; every non-anonymous impersonated user
is in ``system:authenticated``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import errors
from .errors import ApiError
from .rbac import (
    ANONYMOUS,
    AUTHENTICATED,
    MASTERS,
    UNAUTHENTICATED,
    Attributes,
    Decision,
    UserInfo,
    forbidden,
    service_account_user,
    split_service_account,
)

Obj = dict[str, Any]
ADMIN = UserInfo("system:admin", (MASTERS, AUTHENTICATED))
ANONYMOUS_USER = UserInfo(ANONYMOUS, (UNAUTHENTICATED,))
ISSUER = "https://kubernetes.default.svc.cluster.local"
#: A TokenRequest's token lives this long unless it asks otherwise (the real default).
DEFAULT_EXPIRATION_S = 3600
MIN_EXPIRATION_S = 600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Authenticator:
    """Issues ServiceAccount tokens and maps bearer tokens to users.

    ``account`` looks a ServiceAccount up by ``(namespace, name)`` (None when absent)."""

    def __init__(
        self,
        admin_token: str,
        account: Callable[[str, str], Obj | None],
        key: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._admin = f"Bearer {admin_token}".encode()
        self._account = account
        self._key = key or secrets.token_bytes(32)
        self._clock = clock

    def issue(
        self, account: Obj, expiration_s: int | None = None, audiences: list[str] | None = None
    ) -> tuple[str, int | None]:
        """A token for ``account`` and its expiry (epoch seconds; None: lives with the
        account, as the kubelet's mounted token here, which nobody refreshes)."""
        meta = account["metadata"]
        now = int(self._clock())
        claims: dict[str, Any] = {
            "iss": ISSUER,
            "sub": service_account_user(meta["namespace"], meta["name"]).name,
            "aud": audiences or [ISSUER],
            "iat": now,
            "nbf": now,
            "kubernetes.io": {
                "namespace": meta["namespace"],
                "serviceaccount": {"name": meta["name"], "uid": meta["uid"]},
            },
        }
        expires = None if expiration_s is None else now + expiration_s
        if expires is not None:
            claims["exp"] = expires
        head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{head}.{body}.{self._sign(f'{head}.{body}')}", expires

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())

    def authenticate(self, header: str | None) -> UserInfo:
        """The user of an ``Authorization`` header; anonymous without one; 401 otherwise."""
        if header is None:
            return ANONYMOUS_USER
        raw = header.encode("utf-8", "surrogateescape")
        if hmac.compare_digest(raw, self._admin):
            return ADMIN
        scheme, _, token = header.partition(" ")
        user = self._service_account(token.strip()) if scheme == "Bearer" else None
        if user is None:
            raise errors.unauthorized()
        return user

    def _service_account(self, token: str) -> UserInfo | None:
        parts = token.split(".")
        if len(parts) != 3:
            return None
        expected = self._sign(f"{parts[0]}.{parts[1]}").encode()
        if not hmac.compare_digest(parts[2].encode("utf-8", "surrogateescape"), expected):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
            namespace = claims["kubernetes.io"]["namespace"]
            name = claims["kubernetes.io"]["serviceaccount"]["name"]
            uid = claims["kubernetes.io"]["serviceaccount"]["uid"]
        except (ValueError, KeyError, TypeError):
            return None
        if "exp" in claims and claims["exp"] <= self._clock():
            return None
        account = self._account(namespace, name)
        if account is None or account["metadata"].get("uid") != uid:
            return None  # the account was deleted (and maybe made again): the token is dead
        return service_account_user(namespace, name, uid)


def impersonate(
    caller: UserInfo,
    headers: Mapping[str, str],
    groups_requested: list[str],
    check: Callable[[Attributes], Decision],
) -> UserInfo:
    """The user the caller acts as (the caller itself without ``Impersonate-*`` headers);
    403 unless the caller may impersonate each requested user, group and uid."""
    username = headers.get("Impersonate-User")
    uid = headers.get("Impersonate-Uid")
    extras = {k: v for k, v in headers.items() if k.lower().startswith("impersonate-extra-")}
    if username is None:
        if groups_requested or uid or extras:
            raise ApiError(
                500,
                "InternalError",
                "Internal error occurred: requested impersonation of groups or uid "
                "without impersonating a user",
            )
        return caller
    account = split_service_account(username)
    if account is not None:
        _allowed(caller, check, "serviceaccounts", account[1], account[0])
    else:
        _allowed(caller, check, "users", username)
    for group in groups_requested:
        _allowed(caller, check, "groups", group)
    if uid:
        _allowed(caller, check, "uids", uid, group="authentication.k8s.io")
    groups = list(groups_requested)
    if account is not None and not groups:
        groups = list(service_account_user(*account).groups[:2])
    if username != ANONYMOUS and not {AUTHENTICATED, UNAUTHENTICATED} & set(groups):
        groups.append(AUTHENTICATED)
    return UserInfo(username, tuple(groups), uid or "")


def _allowed(
    caller: UserInfo,
    check: Callable[[Attributes], Decision],
    resource: str,
    name: str,
    namespace: str = "",
    group: str = "",
) -> None:
    attributes = Attributes(
        caller,
        "impersonate",
        resource_request=True,
        api_group=group,
        api_version="v1",
        resource=resource,
        name=name,
        namespace=namespace,
    )
    decision = check(attributes)
    if not decision.allowed:
        raise forbidden(attributes, decision.reason)

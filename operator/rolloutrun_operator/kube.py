"""A small async Kubernetes REST client for the handlers: plain JSON in, plain JSON out.

Why not the generated ``kubernetes`` client: the handlers run in Kopf's event loop and work
on plain manifests (what the builders return, what :mod:`observe` parses), so typed models
and a thread per call only add conversions. The ``kubernetes`` package still loads the
credentials (in-cluster ServiceAccount or kubeconfig, with token refresh), so the same code
talks to a real cluster and to the local cluster.

Errors become :class:`KubeError` with the HTTP status chained as data; the handlers decide
what is temporary. :data:`PERMISSIONS` lists exactly the verbs this client uses; the Helm
chart's ClusterRole is checked against it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from rolloutrun_operator.observe import controller_uid, owned_by, owner_text

logger = logging.getLogger(__name__)

Json = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the REST API."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced:
            base += f"/namespaces/{quote(namespace or 'default')}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{quote(name)}"
        if sub is not None:
            base += f"/{sub}"
        return base


RESOURCES: dict[str, Resource] = {
    "Pod": Resource("", "v1", "pods"),
    "ConfigMap": Resource("", "v1", "configmaps"),
    "Secret": Resource("", "v1", "secrets"),
    "Service": Resource("", "v1", "services"),
    "ServiceAccount": Resource("", "v1", "serviceaccounts"),
    "Node": Resource("", "v1", "nodes", namespaced=False),
    "Lease": Resource("coordination.k8s.io", "v1", "leases"),
    "Role": Resource("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": Resource("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "NetworkPolicy": Resource("networking.k8s.io", "v1", "networkpolicies"),
    "RolloutRun": Resource(GROUP, VERSION, PLURAL),
    "Workload": Resource("kueue.x-k8s.io", "v1beta1", "workloads"),
    "ResourceFlavor": Resource("kueue.x-k8s.io", "v1beta1", "resourceflavors", namespaced=False),
}

#: (apiGroup, resource, verbs) this client, Kopf's watches and Kopf's Events use; the chart
#: grants exactly these (the member Role's lease verbs must be held to be granted: RBAC
#: forbids escalation). Kopf's CRD and namespace scanning is off, so it needs no more.
PERMISSIONS: list[tuple[str, str, tuple[str, ...]]] = [
    (GROUP, PLURAL, ("get", "list", "watch", "patch")),
    (GROUP, f"{PLURAL}/status", ("get", "patch")),
    # children set blockOwnerDeletion; OwnerReferencesPermissionEnforcement checks this right
    (GROUP, f"{PLURAL}/finalizers", ("update",)),
    ("", "pods", ("get", "list", "watch", "create", "delete")),
    ("", "configmaps", ("get", "list", "watch", "create", "update")),
    # no list/watch on Secrets: a deleted token Secret comes back at the resync
    ("", "secrets", ("get", "create")),
    ("", "services", ("get", "list", "watch", "create")),
    ("", "serviceaccounts", ("get", "list", "watch", "create")),
    ("", "nodes", ("get",)),
    ("", "events", ("create",)),
    ("coordination.k8s.io", "leases", ("get", "list", "watch", "create", "update", "patch")),
    ("rbac.authorization.k8s.io", "roles", ("get", "list", "watch", "create")),
    ("rbac.authorization.k8s.io", "rolebindings", ("get", "list", "watch", "create", "update")),
    ("networking.k8s.io", "networkpolicies", ("get", "list", "watch", "create")),
    # Kueue admission (runs labelled kueue.x-k8s.io/queue-name): the run's Workload, written
    # as its job controller, and the admitted flavors' node labels and tolerations
    # (update and delete: its podSets follow the run's size, kueue.py)
    ("kueue.x-k8s.io", "workloads", ("get", "list", "watch", "create", "update", "delete")),
    ("kueue.x-k8s.io", "workloads/status", ("patch",)),
    ("kueue.x-k8s.io", "resourceflavors", ("get",)),
]


def permission_rules(
    permissions: list[tuple[str, str, tuple[str, ...]]] | None = None,
) -> list[Json]:
    """:data:`PERMISSIONS` as RBAC PolicyRules, one per entry: what the chart's ClusterRole
    grants (its test compares the rendered rules with these) and what ``rolloutrun run``
    binds the operator's ServiceAccount to on the local cluster."""
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
        for group, resource, verbs in (PERMISSIONS if permissions is None else permissions)
    ]


class KubeError(Exception):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0: no answer), ``detail``
    the API's own message, ``child`` the ``Kind/name`` a create, replace or delete was for."""

    def __init__(self, message: str, status: int = 0, reason: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.detail = detail or message
        self.child: str | None = None
        self.unanswered = False
        """No answer came (connection refused or reset, a timeout): the request may well
        succeed as soon as the API server answers again, unlike one it answered with an
        error."""

    @property
    def refused(self) -> bool:
        """The API refused the request itself (a 4xx other than a conflict or throttling):
        repeating it unchanged gets the same answer."""
        return 400 <= self.status < 500 and self.status not in (404, 409, 429)


class ChildConflict(KubeError):
    """A create found the name taken by an object the run does not control: not adopted.
    ``terminating``: its deletion is under way, so the name is soon free (nothing else
    tells the run: an object without the run's label is not watched)."""

    def __init__(self, ref: str, owner: str, terminating: bool = False) -> None:
        super().__init__(f"{ref} exists and is not owned by this run (owner: {owner})", 409)
        self.reason = "ChildConflict"
        self.ref = ref
        self.owner = owner
        self.terminating = terminating


class NameFreed(KubeError):
    """A create met a 409 but the read-back found no object of that name: its holder ended
    between the two requests (someone else's pod finishing its termination). Nothing was
    created, so nothing may be claimed: the pass ends and the next one observes again."""

    def __init__(self, ref: str) -> None:
        super().__init__(f"{ref} was taken on create and gone on the read-back", 409)
        self.reason = "NameFreed"
        self.child = ref


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate to it."""

    host: str
    token: str | None = None
    ssl_context: ssl.SSLContext | bool = True
    refresh: Any = None
    """The ``kubernetes`` configuration, asked for a fresh token before each request."""
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False

    def authorization(self) -> str | None:
        if self.refresh is not None:
            value = self.refresh.get_api_key_with_prefix("BearerToken", alias="authorization")
            if value:
                return str(value)
        return f"Bearer {self.token}" if self.token else None


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """In-cluster ServiceAccount credentials, else the kubeconfig (``$KUBECONFIG``)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    context: ssl.SSLContext | bool = True
    if configuration.host.startswith("https"):
        if not configuration.verify_ssl:
            context = False
        else:
            ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
            if configuration.cert_file:
                ctx.load_cert_chain(configuration.cert_file, configuration.key_file)
            context = ctx
    return Credentials(
        host=configuration.host.rstrip("/"),
        ssl_context=context,
        refresh=configuration,
        ca_path=configuration.ssl_ca_cert,
        cert_path=configuration.cert_file,
        key_path=configuration.key_file,
        insecure=not configuration.verify_ssl,
    )


#: The reads of the pass under way (:func:`recording_reads`): each ``GET``/``LIST`` named
#: (``GET secrets/x``) with its seconds, so a slow pass's line says which read was slow.
_reads: contextvars.ContextVar[list[tuple[str, float]] | None] = contextvars.ContextVar(
    "rolloutrun_reads", default=None
)


def recording_reads() -> list[tuple[str, float]]:
    """Start recording this task's reads (and those of the tasks it starts) into the list
    returned, filled as each read is answered or fails."""
    reads: list[tuple[str, float]] = []
    _reads.set(reads)
    return reads


def read_name(method: str, path: str) -> str:
    """A read as a pass's timing line names it: ``GET secrets/x``, ``LIST pods``."""
    parts = path.strip("/").split("/")
    if "namespaces" in parts:
        parts = parts[parts.index("namespaces") + 2 :]
    else:
        parts = parts[2:] if parts[0] == "api" else parts[3:]
    verb = "LIST" if method == "GET" and len(parts) == 1 else method
    return f"{verb} {'/'.join(parts)}"


class Kube:
    """Async JSON calls against one API server; one aiohttp session, opened lazily."""

    def __init__(self, credentials: Credentials, timeout: float = 30.0) -> None:
        self.credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Json:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Accept": "application/json"}
        auth = self.credentials.authorization()
        if auth:
            headers["Authorization"] = auth
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        reads, began = _reads.get() if method == "GET" else None, time.monotonic()
        try:
            async with self._session.request(
                method,
                self.credentials.host + path,
                data=data,
                params=params,
                headers=headers,
                ssl=self.credentials.ssl_context,
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    try:
                        answer = json.loads(text)
                    except ValueError:
                        answer = {"message": text}
                    raise KubeError(
                        f"{method} {path}: {response.status} {answer.get('message', '')}",
                        response.status,
                        str(answer.get("reason", "")),
                        str(answer.get("message", "")),
                    )
                return json.loads(text) if text else {}
        except (aiohttp.ClientError, TimeoutError) as error:
            unanswered = KubeError(f"{method} {path}: {error or type(error).__name__}")
            unanswered.unanswered = True
            raise unanswered from error
        except ValueError as error:
            raise KubeError(f"{method} {path}: {error}") from error
        finally:
            if reads is not None:
                reads.append((read_name(method, path), time.monotonic() - began))

    # ------------------------------------------------------------------ conveniences
    async def get(self, kind: str, namespace: str | None, name: str) -> Json | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", RESOURCES[kind].path(namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, selector: str) -> list[Json]:
        answer = await self.request(
            "GET", RESOURCES[kind].path(namespace), params={"labelSelector": selector}
        )
        return list(answer.get("items") or [])

    async def create(self, manifest: Json) -> bool:
        """Create; False when one of that name already exists."""
        meta = manifest["metadata"]
        try:
            await self.request(
                "POST", RESOURCES[manifest["kind"]].path(meta.get("namespace")), manifest
            )
        except KubeError as error:
            if error.status == 409:
                return False
            error.child = f"{manifest['kind']}/{meta.get('name')}"
            raise
        return True

    async def create_owned(self, manifest: Json) -> bool:
        """Create a child; False when the run's own one of that name already exists.

        A 409 is not success by itself: the existing object is read back and kept only if
        its controller is the manifest's (the run's uid); else :class:`ChildConflict`, or
        :class:`NameFreed` when none is left to read."""
        if await self.create(manifest):
            return True
        meta = manifest["metadata"]
        existing = await self.get(manifest["kind"], meta.get("namespace"), meta["name"])
        if existing is None:  # not "existed": a pass counting it would count a child lost
            raise NameFreed(f"{manifest['kind']}/{meta['name']}")
        if not owned_by(existing, controller_uid(manifest) or ""):
            terminating = bool((existing.get("metadata") or {}).get("deletionTimestamp"))
            ref = f"{manifest['kind']}/{meta['name']}"
            raise ChildConflict(ref, owner_text(existing), terminating)
        return False

    async def replace(self, manifest: Json) -> None:
        meta = manifest["metadata"]
        path = RESOURCES[manifest["kind"]].path(meta.get("namespace"), meta["name"])
        try:
            await self.request("PUT", path, manifest)
        except KubeError as error:
            error.child = f"{manifest['kind']}/{meta['name']}"
            raise

    async def delete(
        self,
        kind: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """Delete; False when it was already gone, or (with ``uid``, a precondition) when the
        object of that name now is another one: never the run's to delete."""
        body: Json = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", RESOURCES[kind].path(namespace, name), body)
        except KubeError as error:
            if error.status == 404 or (error.status == 409 and uid is not None):
                return False
            error.child = f"{kind}/{name}"
            raise
        return True

    async def patch(self, kind: str, namespace: str, name: str, body: Json) -> Json:
        """One JSON merge patch of the object (not its status)."""
        return await self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name),
            body,
            content_type="application/merge-patch+json",
        )

    async def patch_status(self, kind: str, namespace: str, name: str, status: Json) -> Json:
        """One JSON merge patch of the status subresource."""
        return await self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name, "status"),
            {"status": status},
            content_type="application/merge-patch+json",
        )

    async def patch_status_at(self, kind: str, namespace: str, name: str, body: Json) -> bool:
        """A merge patch of the status subresource carrying ``metadata.resourceVersion``:
        False (nothing written) when the object changed since it was read, or is gone."""
        try:
            await self.request(
                "PATCH",
                RESOURCES[kind].path(namespace, name, "status"),
                body,
                content_type="application/merge-patch+json",
            )
        except KubeError as error:
            if error.status in (404, 409):
                return False
            error.child = f"{kind}/{name}"
            raise
        return True

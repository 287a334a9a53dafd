"""The run's Lease over plain HTTPS: the keeper's backend, without the ``kubernetes`` client.

Why: the Lease keeper (:mod:`rolloutrun_runtime.lease_keeper`) runs beside a trainer that is
importing torch, on a pod whose two cores both do start-up work. The ``kubernetes`` package
costs ~0.55 s of CPU to import (its package imports its config loaders, dynamic client,
watch and stream modules and ~600 typed models whatever one uses), for two calls on one
object: GET and PUT of ``coordination.k8s.io/v1`` Lease. Here those two calls are made with
the standard library's ``http.client`` and ``ssl`` (~0.02 s), under the same semantics
(:class:`~rolloutrun_runtime.coordination._Lease`: the read, the compare-and-write on
``resourceVersion``, a 409 as a lost race, a transport failure as ``LeaseError``).

Credentials as the client finds them, in its order: the pod's ServiceAccount (in-cluster:
``KUBERNETES_SERVICE_HOST``/``PORT``, the mounted token re-read at each request, as the
kubelet rotates it, and the mounted CA), else the current context of ``$KUBECONFIG`` (or
``~/.kube/config``). A kubeconfig this module does not fully understand (several files, an
``exec`` or ``auth-provider`` plugin, a proxy, any key not listed in :data:`CLUSTER_KEYS` and
:data:`USER_KEYS`) gives None: the caller uses the ``kubernetes`` client's KubernetesLease,
never a Lease with half its credentials.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import ssl
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rolloutrun_runtime.coordination import (
    LeaseError,
    LeaseRecord,
    _Lease,
    format_micro_time,
    parse_time,
)

#: Where the kubelet mounts the pod's ServiceAccount credentials.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: The kubeconfig keys of a cluster and a user this module honours; any other: None.
CLUSTER_KEYS = frozenset(
    {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify"}
)
USER_KEYS = frozenset(
    {
        "token",
        "tokenFile",
        "client-certificate",
        "client-certificate-data",
        "client-key",
        "client-key-data",
    }
)
#: What a kept-alive connection the server closed meanwhile raises (then dialled again once).
STALE_CONNECTION = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
#: Kept-alive connections kept idle between requests (one per request at once, up to this:
#: a fence's GET is not queued behind a renewal's PUT on one socket).
IDLE_CONNECTIONS = 4
LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"


@dataclass(frozen=True)
class ApiAccess:
    """How to reach the API server: its URL, the TLS context, and the bearer token (a
    function, so a rotated token file is read again), if any."""

    server: str
    context: ssl.SSLContext | None
    token: Callable[[], str | None]


def _file_token(path: Path) -> Callable[[], str | None]:
    return lambda: path.read_text().strip() or None


def in_cluster_access(
    environ: Mapping[str, str], account_dir: Path = SERVICE_ACCOUNT_DIR
) -> ApiAccess | None:
    """The pod's ServiceAccount, where the client's ``load_incluster_config`` finds one."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    token, ca = account_dir / "token", account_dir / "ca.crt"
    if not host or not port or not token.is_file() or not ca.is_file():
        return None
    if not token.read_text().strip():
        return None
    host = f"[{host}]" if ":" in host else host
    return ApiAccess(
        f"https://{host}:{port}", ssl.create_default_context(cafile=str(ca)), _file_token(token)
    )


def kubeconfig_access(config: Mapping[str, Any], base: Path) -> ApiAccess | None:
    """The current context of a parsed kubeconfig (``base``: its folder, for relative file
    names); None for anything outside :data:`CLUSTER_KEYS`/:data:`USER_KEYS`."""
    context = _named(config.get("contexts"), config.get("current-context"), "context")
    if context is None:
        return None
    cluster = _named(config.get("clusters"), context.get("cluster"), "cluster")
    user = _named(config.get("users"), context.get("user"), "user")
    if cluster is None or user is None or not cluster.get("server"):
        return None
    if set(cluster) - CLUSTER_KEYS or set(user) - USER_KEYS:
        return None
    server = str(cluster["server"]).rstrip("/")
    scheme = urlsplit(server).scheme
    if scheme not in {"https", "http"} or urlsplit(server).path:
        return None
    context_ssl = None
    if scheme == "https":
        context_ssl = _tls(cluster, user, base)
    token: Callable[[], str | None] = lambda: None  # noqa: E731
    if user.get("token"):
        token = lambda: str(user["token"])  # noqa: E731
    elif user.get("tokenFile"):
        token = _file_token(base / str(user["tokenFile"]))
    return ApiAccess(server, context_ssl, token)


def _named(items: Any, name: Any, key: str) -> dict[str, Any] | None:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            found = item.get(key)
            return dict(found) if isinstance(found, dict) else {}
    return None


def _tls(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> ssl.SSLContext:
    """Trusting only the cluster's CA where it names one, as the client does (the system's
    CAs only where it names none: loading them costs ~40 ms of CPU)."""
    if cluster.get("insecure-skip-tls-verify"):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif cluster.get("certificate-authority-data"):
        pem = base64.b64decode(cluster["certificate-authority-data"]).decode()
        context = ssl.create_default_context(cadata=pem)
    elif cluster.get("certificate-authority"):
        context = ssl.create_default_context(
            cafile=str(base / str(cluster["certificate-authority"]))
        )
    else:
        context = ssl.create_default_context()
    cert = _pem(user, "client-certificate", base)
    key = _pem(user, "client-key", base)
    if cert is not None:
        with tempfile.TemporaryDirectory() as scratch:  # ssl loads a chain from files only
            cert_file, key_file = Path(scratch, "cert.pem"), Path(scratch, "key.pem")
            cert_file.write_bytes(cert)
            key_file.write_bytes(key or b"")
            context.load_cert_chain(str(cert_file), str(key_file) if key else None)
    return context


def _pem(user: Mapping[str, Any], key: str, base: Path) -> bytes | None:
    if user.get(f"{key}-data"):
        return base64.b64decode(user[f"{key}-data"])
    if user.get(key):
        return (base / str(user[key])).read_bytes()
    return None


def access_from_environment(environ: Mapping[str, str]) -> ApiAccess | None:
    """In-cluster first, then one kubeconfig file, as the ``kubernetes`` client looks."""
    found = in_cluster_access(environ)
    if found is not None:
        return found
    name = environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    if os.pathsep in name:  # several files merged: the client's job
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        return None
    import yaml

    config = yaml.safe_load(path.read_text())
    return kubeconfig_access(config, path.parent) if isinstance(config, dict) else None


class RestLease(_Lease):
    """A ``coordination.k8s.io/v1`` Lease read (GET) and replaced (PUT, ``resourceVersion``
    checked) over kept-alive HTTPS connections, one per request in flight (a read is never
    queued behind a write on one socket). The body read is the body written back, with only
    the holder fields, the annotations and the version changed."""

    def __init__(
        self,
        name: str,
        namespace: str,
        identity: str,
        incarnation: int,
        access: ApiAccess,
        request_timeout: float = 10.0,
        **options: Any,
    ) -> None:
        super().__init__(identity, incarnation, **options)
        self.name = name
        self.namespace = namespace
        self.access = access
        self.request_timeout = request_timeout
        self.path = LEASES_PATH.format(namespace=namespace, name=name)
        self._idle: list[http.client.HTTPConnection] = []  # kept alive, none in use
        self._pool = threading.Lock()
        self._local = threading.local()  # .last: the Lease this thread read, for its write

    def _connect(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.access.server)
        host, port = parts.hostname or "", parts.port
        if parts.scheme == "https":
            return http.client.HTTPSConnection(
                host, port, timeout=self.request_timeout, context=self.access.context
            )
        return http.client.HTTPConnection(host, port, timeout=self.request_timeout)

    def _request(self, verb: str, method: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        """``(status, parsed JSON or text)``; LeaseError when the server cannot be reached.
        A kept-alive connection the server closed meanwhile is replaced by a new one, once."""
        headers = {"Accept": "application/json"}
        token = self.access.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        unreachable = f"{verb} lease {self.namespace}/{self.name}: API server unreachable"
        for attempt in (0, 1):  # the second on a new connection
            with self._pool:
                reused = attempt == 0 and bool(self._idle)
                connection = self._idle.pop() if reused else self._connect()
            try:
                connection.request(method, self.path, body=data, headers=headers)
                response = connection.getresponse()
                raw = response.read()
                break
            except (http.client.HTTPException, OSError) as error:
                with contextlib.suppress(OSError):
                    connection.close()
                stale = isinstance(error, STALE_CONNECTION)
                if not (reused and stale):
                    raise LeaseError(f"{unreachable}: {error}") from error
        self._keep(connection)
        text = raw.decode(errors="replace")
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    def _keep(self, connection: http.client.HTTPConnection) -> None:
        with self._pool:
            if len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(connection)
                return
        connection.close()

    def _read(self) -> tuple[LeaseRecord, str]:
        status, lease = self._request("reading", "GET", None)
        where = f"{self.namespace}/{self.name}"
        if status == 404:
            raise LeaseError(f"lease {where} not found (the operator creates it)")
        if status >= 400 or not isinstance(lease, dict):
            raise LeaseError(f"reading lease {where}: {status} {_reason(lease)}")
        self._local.last = lease
        spec = lease.get("spec") or {}
        metadata = lease.get("metadata") or {}
        record = LeaseRecord(
            holder=spec.get("holderIdentity") or None,
            acquire_time=parse_time(spec.get("acquireTime")),
            renew_time=parse_time(spec.get("renewTime")),
            duration_seconds=int(spec.get("leaseDurationSeconds") or self.duration_seconds),
            annotations=dict(metadata.get("annotations") or {}),
        )
        return record, str(metadata.get("resourceVersion"))

    def _write(self, record: LeaseRecord, version: str) -> bool:
        lease = json.loads(json.dumps(self._local.last))  # the body as read, changed below
        metadata = lease.setdefault("metadata", {})
        metadata["resourceVersion"] = version
        metadata["annotations"] = dict(record.annotations)
        spec = lease.get("spec") or {}
        lease["spec"] = spec
        spec["holderIdentity"] = record.holder
        spec["leaseDurationSeconds"] = record.duration_seconds
        spec["acquireTime"] = _micro(record.acquire_time)
        spec["renewTime"] = _micro(record.renew_time)
        status, answer = self._request("writing", "PUT", lease)
        if status == 409:
            return False
        if status >= 400:
            where = f"{self.namespace}/{self.name}"
            raise LeaseError(f"writing lease {where}: {status} {_reason(answer)}")
        return True


def _micro(moment: Any) -> str | None:
    return None if moment is None else format_micro_time(moment)


def _reason(answer: Any) -> str:
    if isinstance(answer, dict):
        return str(answer.get("message") or answer.get("reason") or answer)
    return str(answer)[:200]


def rest_lease_from_environment(
    environ: Mapping[str, str] | None = None, **options: Any
) -> RestLease | None:
    """The run's Lease as :func:`~rolloutrun_runtime.coordination.lease_from_environment`
    builds it in a pod (the same name, identity, incarnation and duration), over plain
    HTTPS; None outside a pod or where the credentials need the ``kubernetes`` client."""
    from rolloutrun_runtime.contract.pod import (
        ENV_INCARNATION,
        ENV_LEASE_NAME,
        ENV_POD_NAME,
        ENV_POD_NAMESPACE,
        holder_identity,
        lease_duration_from,
    )

    env = os.environ if environ is None else environ
    name, namespace = env.get(ENV_LEASE_NAME), env.get(ENV_POD_NAMESPACE)
    if not name or not namespace:
        return None
    access = access_from_environment(env)
    if access is None:
        return None
    incarnation = int(env.get(ENV_INCARNATION, "0") or 0)
    identity = holder_identity(env.get(ENV_POD_NAME) or f"local-{os.getpid()}", incarnation)
    return RestLease(
        name,
        namespace,
        identity,
        incarnation,
        access,
        duration_seconds=lease_duration_from(env),
        **options,
    )

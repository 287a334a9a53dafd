"""Prometheus metrics of the operator: runs by condition, restarts, reconcile latency.

Why a private registry: the embedded default and the tests run operators inside one
process; a registry per operator keeps their numbers apart and never collides with the
global default registry of an application that embeds us.

Why a bearer token on ``/metrics`` (``--metrics-token-file``): every endpoint is
authenticated. Of the ways real operators guard it, a token from a Secret the chart creates
and its ServiceMonitor references needs no sidecar image and no extra rights (the kubelet
mounts the Secret); the TokenReview + SubjectAccessReview way would add a cluster-wide
``tokenreviews``/``subjectaccessreviews`` grant even to a namespaced install and an API call
per scrape. The file is read at each scrape, so a rotated Secret takes effect without a
restart, and a missing or empty file answers 401 (fails closed). Serving beyond loopback
without a token is refused; on loopback (a developer's ``rolloutrun operator``, the local
cluster) it stays open, since only the same host or pod reaches it. ``/healthz`` is Kopf's,
on its own port, and stays open for the kubelet's probes.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from rolloutrun_operator.api.v1alpha1 import ConditionStatus, RolloutRunStatus
from rolloutrun_operator.conditions import ConditionType

logger = logging.getLogger(__name__)


class Metrics:
    """The operator's metrics, updated after every pass."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.runs = Gauge(
            "rolloutrun_runs",
            "RolloutRuns whose condition is True, by condition type.",
            ["condition"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "rolloutrun_restarts",
            "Incarnations ended by a lost member, by kind (failure, preemption) and reason.",
            ["kind", "reason"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "rolloutrun_reconcile_duration_seconds",
            "Time of one reconcile pass (fetch, decide, apply, write status).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "rolloutrun_reconcile_errors",
            "Reconcile passes that failed on an API error and were retried.",
            registry=self.registry,
        )
        self._true: dict[tuple[str, str], frozenset[str]] = {}
        self._server: Any = None
        self._thread: Any = None
        for kind in ConditionType:
            self.runs.labels(condition=str(kind)).set(0)

    def record_run(
        self, namespace: str, name: str, old: RolloutRunStatus | None, new: RolloutRunStatus
    ) -> None:
        """Update the gauges for one run and count a restart if this pass ended an incarnation."""
        self._true[(namespace, name)] = frozenset(
            c.type for c in new.conditions if c.status is ConditionStatus.TRUE
        )
        self._publish()
        before = old or RolloutRunStatus()
        reason = new.last_failure.reason if new.last_failure else "Unknown"
        if new.restarts > before.restarts:
            self.restarts.labels(kind="failure", reason=reason).inc(new.restarts - before.restarts)
        if new.preemptions > before.preemptions:
            self.restarts.labels(kind="preemption", reason=reason).inc(
                new.preemptions - before.preemptions
            )

    def forget_run(self, namespace: str, name: str) -> None:
        self._true.pop((namespace, name), None)
        self._publish()

    def _publish(self) -> None:
        tally = Tally(kind for kinds in self._true.values() for kind in kinds)
        for kind in ConditionType:
            self.runs.labels(condition=str(kind)).set(tally.get(str(kind), 0))

    def serve(self, port: int, address: str, token_file: str | None = None) -> int:
        """Expose ``/metrics`` on ``address:port`` (a daemon thread); the port bound.

        With ``token_file``, a scrape needs ``Authorization: Bearer <its content>`` (else
        401); without one, only a loopback ``address`` is served (:func:`token_problem`)."""
        problem = token_problem(address, token_file)
        if problem is not None:
            raise ValueError(problem)
        app = make_wsgi_app(self.registry)
        if token_file is not None:
            app = bearer_guard(app, lambda: read_token(token_file))
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        server: Any = make_server(address, port, app, server_class, handler_class=_Quiet)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        bound = int(server.server_port)
        guard = "bearer token" if token_file else "no token: loopback only"
        logger.info("serving metrics on http://%s:%d/metrics (%s)", address, bound, guard)
        return bound

    def close(self) -> None:
        """Stop serving (if serving)."""
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join()
            self._server = None


# ------------------------------------------------------------------- the /metrics guard
WsgiApp = Callable[[dict[str, Any], Any], Iterable[bytes]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log: a scrape every 30 s is noise."""


def token_problem(address: str, token_file: str | None, read: bool = True) -> str | None:
    """Why ``/metrics`` may not be served so, or None: beyond loopback it needs a token;
    a token file must be readable and not empty (unless ``read`` is false)."""
    if token_file is not None and not read:
        return None
    if token_file is not None:
        try:
            read_token(token_file, strict=True)
        except ValueError as error:
            return str(error)
        return None
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = address == "localhost"
    if loopback:
        return None
    return (
        f"--metrics-address {address} serves /metrics beyond loopback: pass "
        "--metrics-token-file FILE (the bearer token scrapers send; the chart mounts its "
        "metrics Secret there), or bind 127.0.0.1, or --metrics-port 0"
    )


def read_token(path: str, strict: bool = False) -> str:
    """The token in ``path`` (surrounding whitespace dropped); "" when unreadable, or a
    ValueError naming the problem when ``strict`` (at startup)."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as error:
        if strict:
            raise ValueError(f"--metrics-token-file {path}: cannot read it: {error}") from error
        return ""
    if strict and not token:
        raise ValueError(f"--metrics-token-file {path} is empty")
    return token


def bearer_guard(app: WsgiApp, token: Callable[[], str]) -> WsgiApp:
    """``app`` behind ``Authorization: Bearer <token()>`` (constant-time; an empty token
    admits no one); anything else gets 401."""

    def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        expected = token()
        supplied = str(environ.get("HTTP_AUTHORIZATION", ""))
        if expected and hmac.compare_digest(supplied.encode(), f"Bearer {expected}".encode()):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="metrics"'),
            ],
        )
        return [b"missing or wrong bearer token (the operator's metrics token)\n"]

    return guarded

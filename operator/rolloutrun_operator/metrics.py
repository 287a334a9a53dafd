"""Prometheus metrics of the operator: runs by condition, restarts, reconcile latency.

Why a private registry: the embedded default and the tests run operators inside one
process; a registry per operator keeps their numbers apart and never collides with the
global default registry of an application that embeds us.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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

    def serve(self, port: int, address: str) -> int:
        """Expose ``/metrics`` on ``address:port`` (a daemon thread); the port bound."""
        self._server, self._thread = start_http_server(port, addr=address, registry=self.registry)
        bound = int(self._server.server_port)
        logger.info("serving metrics on http://%s:%d/metrics", address, bound)
        return bound

    def close(self) -> None:
        """Stop serving (if serving)."""
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join()
            self._server = None

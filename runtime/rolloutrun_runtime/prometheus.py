"""The trainer's Prometheus metrics: ``GET /metrics`` on the trainer pod's metrics port.

Why the exposition format by hand: the runtime image does not install ``prometheus_client``
(it is the operator's), and a dozen gauges in the text format are a few lines. The values
are what a person watching a run asks first: the step, the last reward, how old the newest
snapshot is, how long snapshots paused the rollout pump, how much generation restores threw
away, which incarnation runs; plus the usual ``process_*`` metrics.

Why its own token: every endpoint is authenticated, with the least privilege that serves.
The run's data-plane token would also open the Gyms and the generation API, so the scraper
gets a metrics token instead (``contract.pod.ENV_METRICS_TOKEN``, from the run's metrics
Secret, in the trainer pod only): it opens ``/metrics`` and nothing else, and the
data-plane token does not open ``/metrics``. A call without it is answered 401; a server
given no token refuses to start, as the data-plane servers do. The endpoint serves numbers
and the run's name only; it is bound to the pod IP, and the run's generation NetworkPolicy
admits to this port only the peers of ``spec.network.metricsFrom``.
"""

from __future__ import annotations

import hmac
import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_runtime.contract.pod import ENV_METRICS_PORT, ENV_METRICS_TOKEN, ENV_POD_IP

#: The exposition format version served (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_ROUTE = "/metrics"
PREFIX = "rolloutrun_trainer_"


@dataclass
class TrainerMetrics:
    """The trainer's live numbers, updated by its hooks, rendered at each scrape."""

    run: str
    incarnation: int = 0
    step: int = 0
    weight_version: int = 0
    last_reward: float | None = None
    last_loss: float | None = None
    last_step_time_s: float | None = None
    steps: int = 0
    snapshots_published: int = 0
    last_snapshot_at: float | None = None
    """Wall time of the newest published snapshot (its ``published_at``, else when seen)."""
    pump_paused_s_total: float = 0.0
    last_pump_pause_s: float | None = None
    thrown_away_s_total: float = 0.0
    started_at: float = field(default_factory=time.time)

    def on_step(self, record: dict[str, Any]) -> None:
        self.step = int(record["step"])
        self.weight_version = int(record.get("weight_version", record["step"]))
        self.last_reward = _number(record.get("reward_mean"))
        self.last_loss = _number(record.get("loss"))
        self.last_step_time_s = _number(record.get("step_time_s"))
        self.steps += 1

    def on_published(self, published: dict[str, Any], now: float | None = None) -> None:
        when = published.get("published_at")
        if isinstance(when, str):
            import datetime as dt

            when = dt.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
        self.last_snapshot_at = float(when) if isinstance(when, int | float) else now or time.time()
        self.snapshots_published += 1

    def on_snapshot(self, record: dict[str, Any]) -> None:
        paused = (record.get("timing/rollout_checkpoint") or {}).get("pump_paused_s")
        if isinstance(paused, int | float):
            self.pump_paused_s_total += float(paused)
            self.last_pump_pause_s = float(paused)

    def snapshot_age_s(self, now: float | None = None) -> float | None:
        if self.last_snapshot_at is None:
            return None
        return max(0.0, (now or time.time()) - self.last_snapshot_at)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(
    name: str, kind: str, help_text: str, value: float | None, labels: str
) -> Iterable[str]:
    yield f"# HELP {name} {help_text}"
    yield f"# TYPE {name} {kind}"
    if value is not None:
        yield f"{name}{labels} {float(value)!r}"


def _process_samples() -> Iterable[tuple[str, str, str, float | None]]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    yield "process_cpu_seconds_total", "counter", "CPU seconds", usage.ru_utime + usage.ru_stime
    rss = None
    try:
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = None
    yield "process_resident_memory_bytes", "gauge", "resident memory in bytes", rss


def _samples(metrics: TrainerMetrics, now: float | None) -> list[tuple[str, str, str, Any]]:
    """``(name, type, help, value)`` of every family; a None value has no sample."""
    return [
        ("step", "gauge", "optimizer steps done (the trainer version)", metrics.step),
        ("weight_version", "gauge", "weight version served to generation", metrics.weight_version),
        ("last_reward", "gauge", "mean reward of the last step", metrics.last_reward),
        ("last_loss", "gauge", "loss of the last step", metrics.last_loss),
        ("last_step_seconds", "gauge", "wall time of the last step", metrics.last_step_time_s),
        ("steps_total", "counter", "steps trained by this process", metrics.steps),
        (
            "snapshot_age_seconds",
            "gauge",
            "age of the newest snapshot published by this process",
            metrics.snapshot_age_s(now),
        ),
        (
            "snapshots_published_total",
            "counter",
            "snapshots published by this process",
            metrics.snapshots_published,
        ),
        (
            "pump_paused_seconds_total",
            "counter",
            "time snapshots paused the rollout pump",
            metrics.pump_paused_s_total,
        ),
        (
            "last_pump_pause_seconds",
            "gauge",
            "the last snapshot's rollout pump pause",
            metrics.last_pump_pause_s,
        ),
        (
            "thrown_away_seconds_total",
            "counter",
            "generation time restores threw away, over every incarnation so far",
            metrics.thrown_away_s_total,
        ),
        ("incarnation", "gauge", "the incarnation this trainer runs", metrics.incarnation),
    ]


def render(metrics: TrainerMetrics, now: float | None = None) -> str:
    """The text exposition of ``metrics`` (labelled with the run's name)."""
    labels = f'{{run="{_escape(metrics.run)}"}}'
    families = [
        (PREFIX + name, kind, text, value) for name, kind, text, value in _samples(metrics, now)
    ]
    families.append(
        ("process_start_time_seconds", "gauge", "start time (unix seconds)", metrics.started_at)
    )
    families += list(_process_samples())
    lines = [
        line
        for name, kind, text, value in families
        for line in _family(name, kind, text, value, labels)
    ]
    return "\n".join(lines) + "\n"


def metrics_address(environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """Where to serve: ``$POD_IP`` (else 127.0.0.1) on ``$ROLLOUTRUN_METRICS_PORT``; None
    (no server) when the port is unset, as outside a pod."""
    env = os.environ if environ is None else environ
    port = env.get(ENV_METRICS_PORT)
    if not port:
        return None
    return env.get(ENV_POD_IP) or "127.0.0.1", int(port)


class MissingMetricsTokenError(ValueError):
    """The metrics server was started without a metrics token."""


def metrics_token(token: str | None, environ: dict[str, str] | None = None) -> str:
    """``token``, else :data:`ENV_METRICS_TOKEN`; refuse when neither is set."""
    env = os.environ if environ is None else environ
    resolved = token if token is not None else env.get(ENV_METRICS_TOKEN, "")
    if not resolved:
        raise MissingMetricsTokenError(
            f"the trainer's /metrics needs a metrics token: set {ENV_METRICS_TOKEN} (the "
            "operator gives the trainer the run's metrics Secret) or unset "
            f"{ENV_METRICS_PORT} (no metrics server)"
        )
    return resolved


def authorized(header: str, token: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <token>`` (constant-time)."""
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


class MetricsServer:
    """``GET /metrics`` on the trainer's event loop (aiohttp, as the generation server),
    behind the bearer ``token`` (required: no token, no server)."""

    def __init__(self, metrics: TrainerMetrics, token: str) -> None:
        if not token:
            raise MissingMetricsTokenError("the metrics server needs a non-empty token")
        self.metrics = metrics
        self._token = token
        self._runner: Any = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> MetricsServer:
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            if not authorized(request.headers.get("Authorization", ""), self._token):
                return web.Response(
                    status=401,
                    text="missing or wrong bearer token (the run's metrics token)\n",
                    headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
                )
            return web.Response(
                body=render(self.metrics).encode(), headers={"Content-Type": CONTENT_TYPE}
            )

        app = web.Application()
        app.router.add_get(METRICS_ROUTE, handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

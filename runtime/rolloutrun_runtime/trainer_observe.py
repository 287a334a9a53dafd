"""What the trainer shows while it runs and keeps after it: the run's logs shipped to its
storage, the RunConfig kept beside them, and the Prometheus metrics.

Why apart from ``trainer.py``: the entry point wires the run; this module owns the watching
side (threads that ship logs, the ``/metrics`` server, the thrown-away time read back from
earlier incarnations' traces), started after the storage opens and stopped after the run,
so a run's last lines reach the storage however it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.contract.layout import (
    METRICS_FILE,
    METRICS_LOG,
    TRACE_FILE,
    TRACE_LOG,
    log_segment,
)
from rolloutrun_runtime.contract.pod import ENV_INCARNATION
from rolloutrun_runtime.prometheus import (
    MetricsServer,
    TrainerMetrics,
    metrics_address,
    metrics_token,
)
from rolloutrun_runtime.run_logs import LogShipper, read_log_lines, write_config

if TYPE_CHECKING:
    from rolloutrun_runtime.contract.run_config import RunConfig

logger = logging.getLogger(__name__)


def incarnation_from_environment() -> int:
    return int(os.environ.get(ENV_INCARNATION, "0") or 0)


class Observation:
    """The trainer's logs in storage and its ``/metrics``: start, feed (hooks), stop."""

    def __init__(
        self,
        cfg: RunConfig,
        storage: Any,
        log_dir: Path,
        run_id: str,
        metrics_token: str | None = None,
    ) -> None:
        """``metrics_token``: what ``/metrics`` requires (None: ``ENV_METRICS_TOKEN``)."""
        self.cfg = cfg
        self._metrics_token = metrics_token
        self.storage = storage
        self.log_dir = log_dir
        self.run_id = run_id
        incarnation = incarnation_from_environment()
        self.segment = log_segment(incarnation, int(time.time() * 1000), run_id)
        self.metrics = TrainerMetrics(run=cfg.name, incarnation=incarnation)
        self.server: MetricsServer | None = None
        self.shippers: list[LogShipper] = []
        #: Earlier incarnations' trace lines, read until a step accounts the restore.
        self._prior_trace: asyncio.Future[list[str]] | None = None

    async def start(self) -> Observation:
        """Keep the config, read earlier traces, start shipping and serving."""
        write_config(self.storage, self.segment, self.cfg.model_dump(mode="json", by_alias=True))
        files = [(METRICS_LOG, self.log_dir / METRICS_FILE)]
        if self.cfg.checkpointing.trace:
            # Off the event loop: on an object store, one request per part of every earlier
            # incarnation; the first step after it arrives accounts the restore.
            self._prior_trace = asyncio.ensure_future(
                asyncio.to_thread(read_log_lines, self.storage, TRACE_LOG)
            )
            files.append((TRACE_LOG, self.log_dir / TRACE_FILE))
        self.shippers = [
            LogShipper(self.storage, log, path, self.segment).start() for log, path in files
        ]
        address = metrics_address()
        if address is not None:
            token = metrics_token(self._metrics_token)  # no token: refuse, never serve open
            self.server = await MetricsServer(self.metrics, token).start(*address)
            logger.info("serving metrics on http://%s:%d/metrics", address[0], self.server.port)
        return self

    def on_step(self, record: dict[str, Any]) -> None:
        # By the first step the restore relaunched its groups (its abandoned attempts are in
        # this process's trace); earlier traces may still be on their way.
        prior = self._prior_trace
        if prior is not None and prior.done():
            self._prior_trace = None
            try:
                self._account_restore(_events(prior.result()))
            except Exception as error:  # the metric stays 0; the run goes on
                logger.warning("cannot read earlier traces from the run's storage: %s", error)
        self.metrics.on_step(record)

    def on_published(self, published: dict[str, Any]) -> None:
        self.metrics.on_published(published)

    def on_snapshot(self, record: dict[str, Any]) -> None:
        self.metrics.on_snapshot(record)

    def _account_restore(self, prior: list[dict[str, Any]]) -> None:
        """Thrown-away time over every stop so far: earlier traces plus this restore's
        (its ``attempt_abandoned`` events, written before the first step)."""
        from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import analyze

        path = self.log_dir / TRACE_FILE
        mine = [e for e in _events(_lines(path)) if e.get("run_id") == self.run_id]
        report = analyze(prior + mine).to_json()
        self.metrics.thrown_away_s_total = float(report["thrown_away_s_total"])

    async def stop(self) -> None:
        if self._prior_trace is not None and not self._prior_trace.done():
            self._prior_trace.cancel()
        if self.server is not None:
            await self.server.stop()
        for shipper in self.shippers:
            shipper.close()


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def _events(lines: list[str]) -> list[dict[str, Any]]:
    """Trace events from lines; torn or foreign lines are skipped."""
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and "event" in event and "t" in event and "run_id" in event:
            events.append(event)
    return events

"""The Kopf handlers: the only module with ``@kopf`` decorators, and deliberately thin.

Why a daemon per run rather than change handlers: recovery reacts to things that are not
changes of the RolloutRun (a pod deleted, a Lease that stops being renewed, a node going
NotReady, a backoff elapsing). Each run gets one daemon that loops *pass, then wait*; the
wait ends early when an event on the run, one of its pods or its Lease wakes it, else after
the delay the pass asked for. One loop per run also serializes its passes, so two passes
never race to create the same pod. Every decision is in
:func:`~rolloutrun_operator.reconcile.reconcile`; the I/O in :mod:`actuator`.

Kopf keeps its progress and diff-base in annotations (``status.kopf`` would be pruned by
the structural schema); the operator writes ``status`` itself, once per pass. A failed
pass (an API error, a child the API refused, a bug) is written into ``Ready`` with a Warning
Event, once per distinct failure, and retried after a backoff that doubles up to 5 minutes
(a change of the run wakes it sooner); an invalid spec is reported as a condition and
waited out (a fixed spec wakes the daemon).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf

from rolloutrun_operator import naming
from rolloutrun_operator.actuator import run_pass
from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from rolloutrun_operator.conditions import failure_patch
from rolloutrun_operator.kube import Kube, KubeError, load_credentials
from rolloutrun_operator.metrics import Metrics

registry = kopf.OperatorRegistry()
"""The handlers' own registry: embedding the operator never touches Kopf's global one."""

#: Longest wait between passes with nothing happening.
MAX_IDLE_SECONDS = 30.0
#: First delay after a failed pass; it doubles with each failure in a row, up to the max.
RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 300.0


@dataclass
class Options:
    """How the operator was started (put into Kopf's memo by the command)."""

    kubeconfig: str | None = None
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    metrics_token_file: str | None = None
    """The bearer token ``/metrics`` requires (None: loopback only, no token)."""


class Wakers:
    """One asyncio.Event per run: set by watch events, awaited by the run's daemon.

    Only ever touched on the operator's event loop (the event handlers are ``async`` so Kopf
    runs them there, not in its thread pool: asyncio.Event is not thread-safe)."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def event(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.event(namespace, name).set()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)


def next_pass_delay(requeue_after: float | None) -> float:
    """How long the daemon waits for a wake-up before its next pass: what the pass asked for
    (0 means at once: a backoff that ended, a preemption's restart), at most
    ``MAX_IDLE_SECONDS``."""
    if requeue_after is None:
        return MAX_IDLE_SECONDS
    return min(max(requeue_after, 0.0), MAX_IDLE_SECONDS)


def retry_delay(failures: int) -> float:
    """How long the daemon waits after ``failures`` failed passes in a row (a change of the
    run, such as a fixed spec, still wakes it at once): 5 s doubling, at most 5 min."""
    return min(RETRY_SECONDS * 2.0 ** max(failures - 1, 0), MAX_RETRY_SECONDS)


def describe_failure(error: BaseException) -> tuple[str, str]:
    """The ``Ready`` reason and message of a failed pass: a child the API refused is named
    with the API's own words (``ChildRejected``: a quota, a policy, an invalid field; the
    same request gets the same answer, so it waits for a change); any other API error
    (``ApiError``) or bug (``ReconcileError``) is quoted as it came."""
    if isinstance(error, KubeError):
        if error.child is not None and error.refused:
            return (
                "ChildRejected",
                f"the API refused {error.child}: {error.status} {error.reason}: {error.detail}",
            )
        where = f" ({error.child})" if error.child else ""
        return "ApiError", f"{error}{where}"
    return "ReconcileError", f"{type(error).__name__}: {error}"


async def report_failure(
    kube: Kube,
    namespace: str,
    name: str,
    error: BaseException,
    retry_in: float,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Write the failure into the run's ``Ready`` condition and emit a Warning Event, once
    per distinct failure; an API that cannot be reached leaves it to the log."""
    reason, message = describe_failure(error)
    logger.warning(
        "pass failed (%s), next try in %.0f s: %s",
        reason,
        retry_in,
        message,
        exc_info=None if isinstance(error, KubeError) else error,
    )
    try:
        body = await kube.get("RolloutRun", namespace, name)
        if body is None:
            return
        patch = failure_patch(body.get("status") or {}, reason, message[:32_768], now())
        if patch is None:
            return
        await kube.patch_status("RolloutRun", namespace, name, patch)
    except KubeError as unreported:
        logger.warning("could not report the failure on the run: %s", unreported)
        return
    kopf.event(cast(kopf.Body, body), type="Warning", reason=reason, message=message[:1024])


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def wait_for_wake(wake: asyncio.Event, stopped: Any, timeout: float) -> None:
    """Until ``wake`` is set, the daemon is stopped, or ``timeout`` passes; then clear."""

    async def until_stopped() -> None:
        await stopped.wait()

    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(until_stopped())]
    try:
        await asyncio.wait(waiters, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        wake.clear()


@kopf.on.login(registry=registry)
def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """Kopf uses the same credentials as the operator's client (``--kubeconfig`` honoured)."""
    options: Options = memo.get("options") or Options()
    credentials = load_credentials(options.kubeconfig)
    authorization = credentials.authorization() or ""
    scheme, _space, token = authorization.partition(" ")
    return kopf.ConnectionInfo(
        server=credentials.host,
        scheme=scheme or None,
        token=token or None,
        ca_path=credentials.ca_path,
        certificate_path=credentials.cert_path,
        private_key_path=credentials.key_path,
        insecure=credentials.insecure,
    )


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Annotations for Kopf's own state; the API client, wakers and metrics in the memo."""
    prefix = naming.KOPF_ANNOTATION_PREFIX
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=prefix)
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.scanning.disabled = True  # the CRD exists before the operator starts: fewer rights
    options: Options = memo.get("options") or Options()
    memo["kube"] = Kube(load_credentials(options.kubeconfig))
    memo["wakers"] = Wakers()
    metrics = memo.get("metrics")
    if metrics is None:
        metrics = memo["metrics"] = Metrics()
    if options.metrics_port is not None:
        metrics.serve(options.metrics_port, options.metrics_address, options.metrics_token_file)


@kopf.on.cleanup(registry=registry)
async def close(memo: Any, **_: Any) -> None:
    kube = memo.get("kube")
    if kube is not None:
        await kube.close()
    metrics = memo.get("metrics")
    if metrics is not None:
        metrics.close()


@kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=10.0)
async def keep_running(
    name: str,
    namespace: str | None,
    stopped: kopf.DaemonStopped,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> None:
    """Reconcile the run until it is deleted: pass, emit Events, wait for a wake-up."""
    namespace = namespace or "default"
    kube: Kube = memo["kube"]
    wakers: Wakers = memo["wakers"]
    metrics: Metrics = memo["metrics"]
    wake = wakers.event(namespace, name)
    failures = 0
    while not stopped:
        began = time.perf_counter()
        try:
            outcome = await run_pass(kube, namespace, name, now())
        except Exception as error:  # every failure is reported and retried, none kills the loop
            metrics.reconcile_errors.inc()
            failures += 1
            delay = retry_delay(failures)
            await report_failure(kube, namespace, name, error, delay, logger)
            await wait_for_wake(wake, stopped, delay)
            continue
        finally:
            metrics.reconcile_seconds.observe(time.perf_counter() - began)
        failures = 0
        if outcome is None:
            break
        result = outcome.result
        for action in result.actions:
            logger.debug("applied %s", action)
        metrics.record_run(namespace, name, outcome.previous, result.status)
        for event in result.events:
            body = cast(kopf.Body, outcome.body)
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        await wait_for_wake(wake, stopped, next_pass_delay(result.requeue_after))
    metrics.forget_run(namespace, name)
    wakers.forget(namespace, name)


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
async def run_changed(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """Any change of the run (spec, suspend, deletion) wakes its daemon."""
    memo["wakers"].wake(namespace, name)


@kopf.on.event("v1", "pods", labels={naming.LABEL_RUN: kopf.PRESENT}, registry=registry)
async def member_changed(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    """A member pod changed phase, got an IP, was evicted or deleted."""
    memo["wakers"].wake(namespace, labels.get(naming.LABEL_RUN))


@kopf.on.event(
    "coordination.k8s.io",
    "v1",
    "leases",
    labels={naming.LABEL_RUN: kopf.PRESENT},
    registry=registry,
)
async def lease_changed(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    """The trainer renewed its Lease or reported progress: mirror it into status."""
    memo["wakers"].wake(namespace, labels.get(naming.LABEL_RUN))


@kopf.on.event(
    "kueue.x-k8s.io",
    "v1beta1",
    "workloads",
    labels={naming.LABEL_RUN: kopf.PRESENT},
    registry=registry,
)
async def workload_changed(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    """Kueue admitted or evicted the run's Workload (without Kueue's CRD at startup Kopf
    logs that it cannot watch it, and the run's passes still look every few seconds)."""
    memo["wakers"].wake(namespace, labels.get(naming.LABEL_RUN))

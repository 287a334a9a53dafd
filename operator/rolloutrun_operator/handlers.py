"""The Kopf handlers: the only module with ``@kopf`` decorators, and deliberately thin.

Why a daemon per run rather than change handlers: recovery reacts to things that are not
changes of the RolloutRun (a pod deleted, a Lease that stops being renewed, a node going
NotReady, a backoff elapsing). Each run gets one daemon that loops *pass, then wait*; the
wait ends early when a change of the run, one of its pods or its Lease's holder wakes it,
else after the delay the pass asked for or when the Lease's expiry is due. One loop per run
also serializes its passes, so two passes never race to create the same pod.

Why label selectors and indexes (see :mod:`watching`): the API load must not grow with the
trainers' renewals. Only pods and Leases with the run label are streamed; a pass reads them
from Kopf indexes (the Leases: from the operator's own watch, :mod:`lease_watch`, which
keeps the renewals out of Kopf's per-event machinery, so a lost pod never waits behind
them) instead of the API; a renewal moves the expiry deadline in memory and wakes
nothing; progress is mirrored into status by one small patch (a new snapshot manifest at
once, the train step alone at most every two minutes). The static children but Secrets
are watched the same way, so one deleted by hand makes its run's pass due (``child_deleted``).
Every decision is in :func:`~rolloutrun_operator.reconcile.reconcile`; the I/O in
:mod:`actuator`.

Kopf keeps its progress and diff-base in annotations (``status.kopf`` would be pruned by
the structural schema); the operator writes ``status`` itself, once per pass. A failed
pass (an API error, a child the API refused, a bug) is written into ``Ready`` with a Warning
Event, once per distinct failure, and retried after a backoff that doubles up to 5 minutes
(a change of the run wakes it sooner); an invalid spec is reported as a condition and
waited out (a fixed spec wakes the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf

from rolloutrun_operator import naming
from rolloutrun_operator.actuator import Known, Outcome, run_pass, status_json
from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from rolloutrun_operator.conditions import failure_patch
from rolloutrun_operator.kube import (
    RESOURCES,
    Json,
    Kube,
    KubeError,
    load_credentials,
    recording_reads,
)
from rolloutrun_operator.lease_watch import LeaseWatch
from rolloutrun_operator.metrics import Metrics
from rolloutrun_operator.reconcile import Result
from rolloutrun_operator.watching import (
    INDEXED_CHILD_KINDS,
    WATCHED_CHILD_KINDS,
    RunMemory,
    child_event_needs_pass,
    expiry_wait,
    idle_step,
    index_catch_up,
    pass_timing,
    quiet_event_handlers,
    rate_after,
)

passes_logger = logging.getLogger(__name__)
"""One line per pass that acted (:func:`~rolloutrun_operator.watching.pass_timing`)."""

registry = kopf.OperatorRegistry()
"""The handlers' own registry: embedding the operator never touches Kopf's global one."""

#: Longest wait between passes with nothing happening (a resync: every change of the run,
#: its pods and its Lease's holder wakes a pass at once, the Lease's expiry is timed).
MAX_IDLE_SECONDS = 1200.0
#: First delay after a failed pass; it doubles with each failure in a row, up to the max.
RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 300.0
#: The same after a pass that got no answer at all (the API server down, restarting, or
#: past the client's timeout): nothing wakes the daemon when it answers again (its watches
#: broke too), and the long backoff kept a run unreconciled for minutes after an outage of
#: seconds. The delay takes a random 50-100 % of this, so runs do not retry in step.
NO_ANSWER_RETRY_SECONDS = 1.0
MAX_NO_ANSWER_RETRY_SECONDS = 30.0
#: Passes under way at once, over all runs. Each pass sends about a dozen requests at once;
#: a thousand runs starting together (an operator restart, a bulk submit) sent twelve
#: thousand, the API server queued them past the client's timeout, and every pass failed
#: and backed off. A steady run's pass does not wait: passes are rare and short.
MAX_CONCURRENT_PASSES = 16


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


def failure_delay(error: BaseException, failures: int, jitter: float) -> float:
    """How long to wait after ``failures`` failed passes in a row, the last with ``error``:
    :func:`retry_delay` for an answered error or a bug; for an API that did not answer,
    ``jitter`` (0.5 to 1) of 1 s doubling to at most 30 s."""
    if isinstance(error, KubeError) and error.unanswered:
        ceiling = NO_ANSWER_RETRY_SECONDS * 2.0 ** max(failures - 1, 0)
        return jitter * min(ceiling, MAX_NO_ANSWER_RETRY_SECONDS)
    return retry_delay(failures)


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
    if isinstance(error, KubeError) and error.unanswered:
        return  # the report would wait for the same API (up to the client's timeout)
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
    quiet_event_handlers(logging.getLogger("kopf.objects"))  # per-event lines at DEBUG
    settings.watching.server_timeout = 300
    settings.scanning.disabled = True  # the CRD exists before the operator starts: fewer rights
    # Only the runs' own children are streamed: not every pod, not the nodes' heartbeat Leases.
    settings.watching.label_selectors["v1", "pods"] = naming.LABEL_RUN
    for kind in WATCHED_CHILD_KINDS:  # a static child deleted by hand (child_deleted)
        settings.watching.label_selectors[_selector(kind)] = naming.LABEL_RUN
    options: Options = memo.get("options") or Options()
    memo["kube"] = Kube(load_credentials(options.kubeconfig))
    memo["wakers"] = Wakers()
    memo["memories"] = {}
    memo["passes"] = asyncio.Semaphore(MAX_CONCURRENT_PASSES)
    # The Leases: a raw watch, not Kopf's per-event handlers (see lease_watch)
    credentials = load_credentials(options.kubeconfig)
    changed = functools.partial(lease_event, memo)
    leases = memo["lease_watch"] = LeaseWatch(credentials, memo.get("namespaces") or (), changed)
    memo["lease_task"] = asyncio.create_task(leases.run(), name="rolloutrun-lease-watch")
    metrics = memo.get("metrics")
    if metrics is None:
        metrics = memo["metrics"] = Metrics()
    if options.metrics_port is not None:
        metrics.serve(options.metrics_port, options.metrics_address, options.metrics_token_file)


@kopf.on.cleanup(registry=registry)
async def close(memo: Any, **_: Any) -> None:
    task = memo.get("lease_task")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    kube = memo.get("kube")
    if kube is not None:
        await kube.close()
    metrics = memo.get("metrics")
    if metrics is not None:
        metrics.close()


def memory_of(memo: Any, namespace: str | None, name: str | None) -> RunMemory:
    memories: dict[tuple[str, str], RunMemory] = memo["memories"]
    return memories.setdefault((namespace or "default", name or ""), RunMemory())


def pass_due(memo: Any, namespace: str | None, run: str | None) -> None:
    """Make a pass of ``run`` due and wake its daemon: a wake-up alone only lets an idle
    daemon look at its deadlines, then sleep again."""
    memory_of(memo, namespace, run).make_due(time.time())
    memo["wakers"].wake(namespace, run)


def indexed(
    pod_index: kopf.Index[tuple[str, str], Json],
    leases: LeaseWatch,
    namespace: str,
    name: str,
    child_indexes: Mapping[str, kopf.Index[tuple[str, str], Json]] | None = None,
) -> Known:
    """The run's pods, Lease and static children as the indexes hold them now."""
    pods = list(pod_index.get((namespace, name), []))
    children = None
    if child_indexes is not None:
        children = {
            f"{kind}/{_name(child)}": child
            for kind, index in child_indexes.items()
            for child in index.get((namespace, name), [])
        }
    return Known(pods, leases.get(namespace, name), children)


async def one_pass(
    kube: Kube,
    memory: RunMemory,
    known: Known,
    namespace: str,
    name: str,
) -> Outcome | None:
    """A full pass from the indexes, or from the API while they lag the last pass's writes
    (the run itself as its last watch event showed it, when that shows the last status
    write: :meth:`~rolloutrun_operator.watching.RunMemory.watched_run`)."""
    memory.dirty, memory.busy, memory.due_since = False, True, None
    memory.passes += 1
    body = memory.watched_run()
    memory.run_version = None  # unknown until the pass ends (a failed write may have landed)
    try:
        if memory.indexes_current(known.pods, known.lease, known.children):
            known.recent = memory.recent_reads(time.monotonic())
            outcome = await run_pass(
                kube, namespace, name, now(), known, memory.lease_for_pass, memory.saw, body=body
            )
        else:
            children = memory.current_children(known.children)
            memory.forget_expectations()
            outcome = await run_pass(
                kube, namespace, name, now(), saw=memory.saw, children=children, body=body
            )
    finally:
        memory.busy = False
    if outcome is not None:
        memory.run_version = outcome.version or None
        memory.wrote_run(outcome.written)
        memory.expect(outcome.result.actions)
        memory.mirrored_progress(status_json(outcome.result.status), time.monotonic())
    return outcome


async def mirror_progress(kube: Kube, memory: RunMemory, namespace: str, name: str) -> None:
    """One status patch with the Lease's progress annotations and the step rate (no pass)."""
    patch = dict(memory.progress)
    patch.update(rate_after(memory.mirrored, patch.get("trainStep"), now()))
    memory.run_version = None  # unknown until the write is answered
    written = await kube.patch_status("RolloutRun", namespace, name, patch)
    memory.run_version = str((written.get("metadata") or {}).get("resourceVersion") or "") or None
    memory.mirrored = {**memory.mirrored, **patch}
    memory.mirrored_at = time.monotonic()


async def idle(
    kube: Kube,
    memory: RunMemory,
    wake: asyncio.Event,
    stopped: kopf.DaemonStopped,
    result: Result,
    namespace: str,
    name: str,
) -> None:
    """Wait until the next pass is due: a wake-up that asks for one, the pass's requeue,
    or the Lease's expiry (moved by each renewal seen); mirror progress meanwhile."""
    other_due = time.monotonic() + next_pass_delay(result.other_requeue_after)
    pass_renew = result.status.lease.renew_time if result.status.lease is not None else None
    while not stopped:
        expiry = expiry_wait(memory, result.lease_expiry, pass_renew, now())
        progress = memory.progress_due(time.monotonic())
        step = idle_step(memory.dirty, other_due - time.monotonic(), expiry, progress)
        if step == 0.0:
            return
        if step < 0:
            try:
                await mirror_progress(kube, memory, namespace, name)
            except KubeError:
                memory.mirrored_at = time.monotonic()  # retried after the throttle
            continue
        await wait_for_wake(wake, stopped, step)


@kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=10.0)
async def keep_running(
    name: str,
    namespace: str | None,
    stopped: kopf.DaemonStopped,
    memo: Any,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **indexes: Any,
) -> None:
    """Reconcile the run until it is deleted: pass, emit Events, wait until one is due.
    Kopf passes the indexes below by their names (``pod_index``); the Lease comes from the
    operator's own Lease watch, once it has listed them."""
    pod_index: kopf.Index[tuple[str, str], Json] = indexes["pod_index"]
    leases: LeaseWatch = memo["lease_watch"]
    child_indexes = {kind: indexes[_child_index_id(kind)] for kind in INDEXED_CHILD_KINDS}
    namespace = namespace or "default"
    kube: Kube = memo["kube"]
    wakers: Wakers = memo["wakers"]
    metrics: Metrics = memo["metrics"]
    wake = wakers.event(namespace, name)
    memory = memory_of(memo, namespace, name)
    failures = 0
    while not (stopped or leases.ready.is_set()):
        with contextlib.suppress(TimeoutError):  # the Leases listed, as Kopf's indexes are
            await asyncio.wait_for(leases.ready.wait(), 1.0)
    while not stopped:
        began, queued = time.perf_counter(), time.time()
        current = functools.partial(indexed, pod_index, leases, namespace, name, child_indexes)
        await index_catch_up(memory, stopped, current)
        try:
            async with memo["passes"]:
                slot, due_since, reads = time.time(), memory.due_since, recording_reads()
                known = indexed(pod_index, leases, namespace, name, child_indexes)
                outcome = await one_pass(kube, memory, known, namespace, name)
        except Exception as error:  # every failure is reported and retried, none kills the loop
            metrics.reconcile_errors.inc()
            memory.failures = failures = failures + 1
            delay = memory.retry_in = failure_delay(error, failures, random.uniform(0.5, 1.0))
            memory.forget_expectations()
            memory.read.clear()
            await report_failure(kube, namespace, name, error, delay, logger)
            await wait_for_wake(wake, stopped, delay)
            continue
        finally:
            metrics.reconcile_seconds.observe(time.perf_counter() - began)
        failures = memory.failures = 0
        if outcome is None:
            break
        result = outcome.result
        for action in result.actions:
            logger.debug("applied %s", action)
        if result.actions:
            done, acted = time.time(), len(result.actions)
            timing = pass_timing(due_since, queued, slot, done, acted, reads)
            passes_logger.info("pass of %s/%s: %s", namespace, name, timing)
        metrics.record_run(namespace, name, outcome.previous, result.status)
        for event in result.events:
            body = cast(kopf.Body, outcome.body)
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        if result.actions:
            memory.dirty = True  # look again once the indexes show what this pass did
            await wait_for_wake(wake, stopped, next_pass_delay(result.requeue_after))
            continue
        await idle(kube, memory, wake, stopped, result, namespace, name)
    metrics.forget_run(namespace, name)
    wakers.forget(namespace, name)
    memo["memories"].pop((namespace, name), None)


@kopf.index("v1", "pods", labels={naming.LABEL_RUN: kopf.PRESENT}, registry=registry)
async def pod_index(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Json]:
    """The member pods by run (labels as the operator writes them; ownership is checked in
    the pass)."""
    return {(namespace or "default", labels[naming.LABEL_RUN]): dict(body)}


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
async def run_changed(
    name: str, namespace: str | None, body: kopf.Body, type: str | None, memo: Any, **_: Any
) -> None:
    """A change of the run's spec, deletion, labels or annotations wakes its daemon (its
    own status writes do not)."""
    memory = memory_of(memo, namespace, name)
    memory.run_body = None if type == "DELETED" else dict(body)
    if type == "DELETED" or memory.saw_run(body):
        memory.make_due(time.time())
        memo["wakers"].wake(namespace, name)


@kopf.on.event("v1", "pods", labels={naming.LABEL_RUN: kopf.PRESENT}, registry=registry)
async def member_changed(
    name: str,
    namespace: str | None,
    labels: Mapping[str, str],
    type: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """A member pod changed phase, got an IP, was evicted or deleted."""
    run = labels.get(naming.LABEL_RUN)
    if run:
        memory_of(memo, namespace, run).watched("Pod", name, type == "DELETED")
    pass_due(memo, namespace, run)


def lease_event(memo: Any, namespace: str, run: str, body: Json | None) -> None:
    """The run's Lease changed (:class:`~.lease_watch.LeaseWatch`, no Kopf handler): a new
    holder wakes a pass; a renewal only moves the expiry; progress is mirrored by the
    daemon at most once per ``PROGRESS_MIRROR_SECONDS``."""
    memory = memory_of(memo, namespace, run)
    memory.watched("Lease", naming.lease_name(run), body is None)
    before = memory.progress_due(time.monotonic())
    asks_pass = memory.saw_lease(body or {}, now(), deleted=body is None)
    if asks_pass:
        memory.make_due(time.time())
    due = memory.progress_due(time.monotonic())
    if asks_pass or (due is not None and (before is None or due < before)):
        memo["wakers"].wake(namespace, run)  # a pass, or progress due sooner than planned


def _name(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


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
    logs that it cannot watch it, and a held run's passes still look every 30 s): a pass is
    due, not only a wake-up (an idle daemon goes back to sleep unless one is)."""
    pass_due(memo, namespace, labels.get(naming.LABEL_RUN))


def _selector(kind: str) -> tuple[str, str, str]:
    """Kopf's (group, version, plural) of one of the operator's :data:`RESOURCES`."""
    resource = RESOURCES[kind]
    return resource.group, resource.version, resource.plural


async def child_deleted(
    name: str,
    namespace: str | None,
    labels: Mapping[str, str],
    type: str | None,
    body: kopf.Body,
    memo: Any,
    **_: Any,
) -> None:
    """A static child of a running run (its Service, ConfigMap, NetworkPolicy, RBAC) was
    deleted: the pass that recreates it is due now, not at the resync
    (:func:`~rolloutrun_operator.watching.child_event_needs_pass`)."""
    run = labels.get(naming.LABEL_RUN)
    known = (namespace or "default", run or "") in memo["memories"]
    kind = str(body.get("kind") or "")
    if known and kind and name:
        memory_of(memo, namespace, run).watched(kind, name, type == "DELETED")
    if child_event_needs_pass(type, known):
        pass_due(memo, namespace, run)


def _child_index_id(kind: str) -> str:
    return f"child_index/{kind}"


async def child_index(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Json]:
    """A run's static children of one kind by run (a pass reads them here, not with GETs;
    ownership is checked in the pass)."""
    return {(namespace or "default", labels[naming.LABEL_RUN]): dict(body)}


for _kind in INDEXED_CHILD_KINDS:
    kopf.index(
        *_selector(_kind),
        id=_child_index_id(_kind),
        labels={naming.LABEL_RUN: kopf.PRESENT},
        registry=registry,
    )(child_index)

for _kind in WATCHED_CHILD_KINDS:
    kopf.on.event(
        *_selector(_kind),
        id=f"child_deleted/{_kind}",
        labels={naming.LABEL_RUN: kopf.PRESENT},
        registry=registry,
    )(child_deleted)

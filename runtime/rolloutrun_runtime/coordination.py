"""The trainer's lease: who may publish snapshots, and where the operator reads progress.

Why: after a preemption the operator starts incarnation N+1 while the trainer of
incarnation N may still be alive (hung, partitioned, slow to die). Both must never publish
manifests. The trainer holds the run's lease, named ``<run>-trainer``, with holder identity
``<pod>/<incarnation>`` and renews it every few seconds; a trainer of a newer incarnation
takes the lease over at once, and before publishing, a trainer calls :meth:`ensure_held`,
which raises :class:`FencedError` once its lease was taken or expired (fencing).

The trainer also records its train step, anchor step and latest manifest on the lease
(annotations); the operator mirrors them into the RolloutRun's status and acts on an expired
lease without waiting for the pod to be evicted.

Two backends with one semantics (:class:`LeaseHolder`): :class:`KubernetesLease` talks to
``coordination.k8s.io/v1`` with the pod's ServiceAccount (which may only get/update its own
run's Lease; the operator creates it) using optimistic concurrency on ``resourceVersion``;
:class:`FileLease` keeps the same record in a JSON file for local runs outside any cluster
(atomic replace, ``fcntl`` lock). Either may be called from several threads at once; a read
(a fence) never waits for a write's round trip, and reads at once share one
(:class:`SharedReads`). This is the only runtime module that imports ``kubernetes``. The
Lease's name, holder identity, annotations and the pod environment it is read from are the
pod contract's (:mod:`rolloutrun_runtime.contract.pod`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rolloutrun_runtime.contract.pod import (
    ANNOTATION_ANCHOR_STEP,
    ANNOTATION_LATEST_MANIFEST,
    ANNOTATION_LATEST_MANIFEST_TIME,
    ANNOTATION_REWARD,
    ANNOTATION_TRAIN_STEP,
    DEFAULT_LEASE_DURATION_S,
    ENV_INCARNATION,
    ENV_LEASE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    holder_identity,
    lease_duration_from,
)
from rolloutrun_runtime.contract.pod import holder_incarnation as incarnation_of

logger = logging.getLogger(__name__)

Clock = Callable[[], dt.datetime]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaseError(RuntimeError):
    """The lease could not be read or written (API unreachable, lease missing)."""


class FencedError(RuntimeError):
    """This trainer no longer holds the lease: another incarnation took it, or it expired."""


def format_micro_time(moment: dt.datetime) -> str:
    """Kubernetes ``MicroTime``: RFC 3339 in UTC with microseconds and a ``Z``."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> dt.datetime | None:
    if not value:
        return None
    if isinstance(value, dt.datetime):  # the typed client's models hold datetimes
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


@dataclass(frozen=True)
class LeaseRecord:
    """The lease's state, the same for both backends."""

    holder: str | None = None
    acquire_time: dt.datetime | None = None
    renew_time: dt.datetime | None = None
    duration_seconds: int = DEFAULT_LEASE_DURATION_S
    annotations: Mapping[str, str] = field(default_factory=dict)

    def expired(self, now: dt.datetime) -> bool:
        if self.renew_time is None:
            return True
        return now >= self.renew_time + dt.timedelta(seconds=self.duration_seconds)


def may_take(record: LeaseRecord, identity: str, incarnation: int, now: dt.datetime) -> bool:
    """Whether ``identity`` may hold the lease now; raises FencedError when it never may.

    Free, expired or already ours: yes. Held by an older incarnation: yes at once (the
    operator ended it). Held by a newer incarnation: this trainer is stale, fenced for good.
    Held by another pod of the same incarnation and still valid: not yet.
    """
    holder = record.holder
    theirs = incarnation_of(holder)
    if holder and holder != identity and theirs is not None and theirs > incarnation:
        raise FencedError(f"lease held by newer incarnation {holder!r}; this is {identity!r}")
    if not holder or holder == identity or record.expired(now):
        return True
    return theirs is not None and theirs < incarnation


@runtime_checkable
class LeaseHolder(Protocol):
    """What the trainer needs from its lease, whatever keeps it."""

    identity: str

    def acquire(self, timeout: float | None = None) -> None:
        """Hold the lease (waiting while another holder of this incarnation still has it)."""

    def renew(self) -> None:
        """Renew once; FencedError when the lease was lost."""

    def ensure_held(self) -> None:
        """FencedError unless this trainer holds an unexpired lease (call before publishing)."""

    def record_progress(
        self,
        train_step: int | None = None,
        anchor_step: int | None = None,
        latest_manifest: str | None = None,
        latest_manifest_time: dt.datetime | None = None,
        reward: float | None = None,
    ) -> None:
        """Write progress annotations (only while holding the lease)."""

    def start_renewing(self, interval: float | None = None) -> None:
        """Renew in a background thread until :meth:`stop`."""

    def stop(self, release: bool = False) -> None:
        """Stop renewing; ``release`` gives the lease up (clean exit)."""

    def annotations(self, fresh: bool = False) -> Mapping[str, str]:
        """The Lease's annotations as last read (by a renewal), or read now (``fresh``)."""


class _Read:
    """One read of the Lease that the callers who asked before it started share."""

    def __init__(self) -> None:
        self.started = self.done = False
        self.record: LeaseRecord | None = None
        self.error: BaseException | None = None


class SharedReads:
    """Fresh reads, single-flight: a caller joins the next read not yet started (it starts
    once the one in flight ends): its answer is from a read begun after it asked (never a
    cached one), and N callers at once cost at most two reads. Why: a fence waited up to
    2.4 s behind the members' address reads of a trainer whose Gym was down."""

    def __init__(self, read: Callable[[], LeaseRecord]) -> None:
        self._read = read
        self._state = threading.Condition()
        self._reading = False  # a read is in flight
        self._next: _Read | None = None  # the read the callers asking now will share

    def __call__(self) -> LeaseRecord:
        with self._state:
            if self._next is None:
                self._next = _Read()
            shared = self._next
            while self._reading and not shared.started:
                self._state.wait()
            lead = not shared.started
            if lead:  # nothing in flight: this caller reads for everyone who asked so far
                shared.started, self._reading, self._next = True, True, None
        if lead:
            try:
                shared.record = self._read()
            except BaseException as error:
                shared.error = error
        with self._state:
            if lead:
                shared.done, self._reading = True, False
                self._state.notify_all()
            while not shared.done:
                self._state.wait()
        if shared.error is not None:
            raise shared.error
        assert shared.record is not None
        return shared.record


class _Lease:
    """The semantics of :class:`LeaseHolder` over a versioned read/compare-and-write store.

    Writes (acquire, renew, progress, release) are read-modify-writes under one mutex; reads
    (a fence, fresh annotations) take none and share a read (:class:`SharedReads`), so a
    backend's ``_read``/``_write`` run on several threads at once (a write sends back the
    body its own thread read)."""

    def __init__(
        self,
        identity: str,
        incarnation: int,
        duration_seconds: int = DEFAULT_LEASE_DURATION_S,
        clock: Clock = utcnow,
        on_lost: Callable[[FencedError], None] | None = None,
    ) -> None:
        self.identity = identity
        self.incarnation = incarnation
        self.duration_seconds = duration_seconds
        self.clock = clock
        self.on_lost = on_lost
        self.lost: FencedError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()  # read-modify-writes, one at a time
        self._annotations: Mapping[str, str] = {}
        self._fresh = SharedReads(self._read_record)

    # backends implement these two
    def _read(self) -> tuple[LeaseRecord, str]:
        raise NotImplementedError

    def _write(self, record: LeaseRecord, version: str) -> bool:
        """Write if the stored version is still ``version``; False on a conflict."""
        raise NotImplementedError

    def _read_record(self) -> LeaseRecord:
        record, _ = self._read()
        self._annotations = dict(record.annotations)
        return record

    # ------------------------------------------------------------------ operations
    def _update(self, change: Callable[[LeaseRecord], LeaseRecord | None]) -> LeaseRecord | None:
        with self._mutex:
            for _ in range(8):
                record, version = self._read()
                self._annotations = dict(record.annotations)
                new = change(record)
                if new is None or self._write(new, version):
                    return new
        raise LeaseError(f"lease {self.identity!r}: too many conflicting writers")

    def try_acquire(self) -> bool:
        """One attempt to take or keep the lease; True when held."""

        def take(record: LeaseRecord) -> LeaseRecord | None:
            now = self.clock()
            if not may_take(record, self.identity, self.incarnation, now):
                return None
            acquired = record.acquire_time if record.holder == self.identity else now
            return replace(
                record,
                holder=self.identity,
                acquire_time=acquired,
                renew_time=now,
                duration_seconds=self.duration_seconds,
            )

        return self._update(take) is not None

    def acquire(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else self.clock() + dt.timedelta(seconds=timeout)
        poll = max(self.duration_seconds / 10, 0.05)
        while not self.try_acquire():
            if deadline is not None and self.clock() >= deadline:
                raise TimeoutError(f"lease not acquired as {self.identity!r} within {timeout}s")
            if self._stop.wait(poll):
                raise LeaseError("stopped while acquiring the lease")
        self.lost = None
        logger.info("lease acquired as %s", self.identity)

    def _check(self, record: LeaseRecord) -> None:
        if record.holder != self.identity:
            raise FencedError(f"lease now held by {record.holder!r}, not {self.identity!r}")
        if record.expired(self.clock()):
            raise FencedError(f"lease of {self.identity!r} expired at {record.renew_time}")

    def renew(self) -> None:
        def extend(record: LeaseRecord) -> LeaseRecord:
            self._check(record)
            return replace(record, renew_time=self.clock())

        self._update(extend)

    def ensure_held(self) -> None:
        if self.lost is not None:
            raise self.lost
        self._check(self._fresh())  # a read that started after this call (never a cached one)

    def record_progress(
        self,
        train_step: int | None = None,
        anchor_step: int | None = None,
        latest_manifest: str | None = None,
        latest_manifest_time: dt.datetime | None = None,
        reward: float | None = None,
    ) -> None:
        if latest_manifest is not None and latest_manifest_time is None:
            latest_manifest_time = self.clock()
        values = {
            ANNOTATION_TRAIN_STEP: None if train_step is None else str(train_step),
            ANNOTATION_ANCHOR_STEP: None if anchor_step is None else str(anchor_step),
            ANNOTATION_LATEST_MANIFEST: latest_manifest,
            ANNOTATION_LATEST_MANIFEST_TIME: None
            if latest_manifest_time is None
            else latest_manifest_time.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            ANNOTATION_REWARD: None
            if reward is None or not math.isfinite(reward)
            else f"{reward:.6g}",
        }
        changes = {key: value for key, value in values.items() if value is not None}

        def annotate(record: LeaseRecord) -> LeaseRecord:
            self._check(record)
            return replace(record, annotations={**record.annotations, **changes})

        self._update(annotate)

    def annotations(self, fresh: bool = False) -> Mapping[str, str]:
        """What the operator wrote there too (the replaced members' addresses): as the last
        renewal read them, or read now (a GET shared with the reads asked meanwhile) with
        ``fresh``."""
        if fresh:
            return dict(self._fresh().annotations)
        return self._annotations

    def release(self) -> None:
        def drop(record: LeaseRecord) -> LeaseRecord | None:
            if record.holder != self.identity:
                return None
            return replace(record, holder=None, acquire_time=None, renew_time=None)

        self._update(drop)

    # ------------------------------------------------------------- background renewal
    def start_renewing(self, interval: float | None = None) -> None:
        if self._thread is not None:
            return
        period = interval if interval is not None else max(self.duration_seconds / 3, 0.05)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._renew_loop, args=(period,), name="lease-renewal", daemon=True
        )
        self._thread.start()

    def _renew_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.renew()
            except FencedError as error:
                logger.error("lease lost: %s", error)
                self.lost = error
                if self.on_lost is not None:
                    self.on_lost(error)
                return
            except (LeaseError, OSError) as error:
                logger.warning("lease renewal failed, retrying: %s", error)

    def stop(self, release: bool = False) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if release and self.lost is None:
            try:
                self.release()
            except (LeaseError, OSError) as error:
                logger.warning("lease release failed: %s", error)


# --------------------------------------------------------------------------- file lease
class FileLease(_Lease):
    """The lease as a JSON file, for local runs: atomic replace, writers serialized by flock."""

    def __init__(self, path: str | Path, identity: str, incarnation: int, **options: Any):
        super().__init__(identity, incarnation, **options)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    def _load(self) -> tuple[LeaseRecord, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return LeaseRecord(duration_seconds=self.duration_seconds), "0"
        except ValueError as error:
            raise LeaseError(f"{self.path}: not a lease file: {error}") from error
        record = LeaseRecord(
            holder=data.get("holderIdentity") or None,
            acquire_time=parse_time(data.get("acquireTime")),
            renew_time=parse_time(data.get("renewTime")),
            duration_seconds=int(data.get("leaseDurationSeconds") or self.duration_seconds),
            annotations=dict(data.get("annotations") or {}),
        )
        return record, str(data.get("version", "0"))

    def _read(self) -> tuple[LeaseRecord, str]:
        return self._load()

    def _write(self, record: LeaseRecord, version: str) -> bool:
        with open(self._lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                _, current = self._load()
                if current != version:
                    return False
                body = {
                    "holderIdentity": record.holder,
                    "acquireTime": _maybe_time(record.acquire_time),
                    "renewTime": _maybe_time(record.renew_time),
                    "leaseDurationSeconds": record.duration_seconds,
                    "annotations": dict(record.annotations),
                    "version": str(int(current) + 1),
                }
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                with open(tmp, "w") as handle:
                    json.dump(body, handle, sort_keys=True)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, self.path)
                return True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _maybe_time(moment: dt.datetime | None) -> str | None:
    return None if moment is None else format_micro_time(moment)


# --------------------------------------------------------------------- kubernetes lease
class KubernetesLease(_Lease):
    """A ``coordination.k8s.io/v1`` Lease, read and replaced with ``resourceVersion`` checks.

    Only the typed ``CoordinationV1Api`` (``read_namespaced_lease``,
    ``replace_namespaced_lease``) and ``ApiException``: both exist unchanged across the
    supported ``kubernetes>=29`` (``ApiClient`` internals such as ``param_serialize`` do
    not; tests/runtime/coordination/kubernetes_min_surface.json records what 29.0.0 offers).
    Only transport failures read as "API server unreachable"; anything else is a bug and
    propagates as itself.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        identity: str,
        incarnation: int,
        api_client: Any = None,
        request_timeout: float = 10.0,
        **options: Any,
    ) -> None:
        super().__init__(identity, incarnation, **options)
        from kubernetes import client, config

        self.name = name
        self.namespace = namespace
        self.request_timeout = request_timeout
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api = api_client
        self.leases = client.CoordinationV1Api(api_client)
        self._local = threading.local()  # .last: the Lease this thread read, for its write

    def _call(self, verb: str, operation: Callable[[], Any]) -> tuple[int, Any]:
        """``(200, result)``, or ``(status, reason)`` for an HTTP error; LeaseError when the
        API server cannot be reached. Other exceptions are bugs and propagate unchanged."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        unreachable = f"{verb} lease {self.namespace}/{self.name}: API server unreachable"
        try:
            return 200, operation()
        except ApiException as error:
            if not error.status:
                raise LeaseError(f"{unreachable}: {error}") from error
            return int(error.status), f"{error.reason} {error.body or ''}".strip()
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise LeaseError(f"{unreachable}: {error}") from error

    def _read(self) -> tuple[LeaseRecord, str]:
        status, lease = self._call(
            "reading",
            lambda: self.leases.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self.request_timeout
            ),
        )
        if status == 404:
            where = f"{self.namespace}/{self.name}"
            raise LeaseError(f"lease {where} not found (the operator creates it)")
        if status >= 400:
            raise LeaseError(f"reading lease {self.namespace}/{self.name}: {status} {lease}")
        self._local.last = lease
        spec = lease.spec
        record = LeaseRecord(
            holder=(spec and spec.holder_identity) or None,
            acquire_time=parse_time(spec and spec.acquire_time),
            renew_time=parse_time(spec and spec.renew_time),
            duration_seconds=int((spec and spec.lease_duration_seconds) or self.duration_seconds),
            annotations=dict(lease.metadata.annotations or {}),
        )
        return record, str(lease.metadata.resource_version)

    def _write(self, record: LeaseRecord, version: str) -> bool:
        from kubernetes import client

        lease = self._local.last
        lease.metadata.resource_version = version
        lease.metadata.annotations = dict(record.annotations)
        if lease.spec is None:
            lease.spec = client.V1LeaseSpec()
        lease.spec.holder_identity = record.holder
        lease.spec.lease_duration_seconds = record.duration_seconds
        lease.spec.acquire_time = micro_time(record.acquire_time)
        lease.spec.renew_time = micro_time(record.renew_time)
        status, answer = self._call(
            "writing",
            lambda: self.leases.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self.request_timeout
            ),
        )
        if status == 409:
            return False
        if status >= 400:
            raise LeaseError(f"writing lease {self.namespace}/{self.name}: {status} {answer}")
        return True


def micro_time(moment: dt.datetime | None) -> dt.datetime | None:
    """A moment the client serializes as a valid ``MicroTime``.

    The client writes datetimes with ``isoformat()``, which drops the fraction when it is
    zero; the API server's MicroTime wants six digits, so such a moment moves by 1 µs."""
    if moment is None:
        return None
    moment = moment.astimezone(dt.UTC)
    return moment.replace(microsecond=1) if moment.microsecond == 0 else moment


@contextlib.contextmanager
def holding(
    lease: LeaseHolder | None, acquire_timeout: float | None = None
) -> Iterator[LeaseHolder | None]:
    """Acquire ``lease``, renew it in the background, and give it up on a clean exit.

    ``None`` (a plain local run without coordination) passes through, so a trainer writes
    ``with holding(lease_from_environment()) as lease:`` either way. On an exception the
    lease is not released: it expires, and the operator reads that as a lost trainer.
    """
    if lease is None:
        yield None
        return
    lease.acquire(timeout=acquire_timeout)
    lease.start_renewing()
    try:
        yield lease
    except BaseException:
        lease.stop(release=False)
        raise
    lease.stop(release=True)


def lease_from_environment(
    environ: Mapping[str, str] | None = None, local_path: str | Path | None = None, **options: Any
) -> LeaseHolder | None:
    """The trainer's lease as its pod environment describes it (see the operator's builders).

    In a pod (``ROLLOUTRUN_LEASE_NAME`` and ``POD_NAMESPACE`` set): a KubernetesLease. Else,
    with ``local_path``: a FileLease there. Else None (no coordination: a plain local run).
    """
    env = os.environ if environ is None else environ
    incarnation = int(env.get(ENV_INCARNATION, "0") or 0)
    duration = lease_duration_from(env)
    pod = env.get(ENV_POD_NAME) or f"local-{os.getpid()}"
    identity = holder_identity(pod, incarnation)
    name, namespace = env.get(ENV_LEASE_NAME), env.get(ENV_POD_NAMESPACE)
    if name and namespace:
        return KubernetesLease(
            name, namespace, identity, incarnation, duration_seconds=duration, **options
        )
    if local_path is not None:
        return FileLease(local_path, identity, incarnation, duration_seconds=duration, **options)
    return None

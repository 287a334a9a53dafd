"""The hollow node's kubelet and the runs' trainers of ``bench.operator_scale``.

Why a module of its own: each runs in a process of its own (``python -m bench.operator_scale
--hollow NAMESPACE --hollow-role kubelet|trainers``), so neither shares an interpreter lock
with the API server (in the benchmark's process) or with the other: the kubelet's pod writes
do not queue behind a thousand trainers' renewals, as a node's kubelet's do not on a cluster.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import heapq
import os
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.operator_recovery import drained, micro_now
from rolloutrun_operator.gc_pacing import with_paced_gc

HOLLOW = "hollow"
#: The runs' ``leaseDurationSeconds`` (``--lease-seconds``): trainers renew every third of it.
LEASE_DURATION_S = 15
ANCHOR_EVERY_S = 60.0
#: Renewals in flight at once. A thousand trainers renew each on its own connection, so one
#: slow answer never delays another trainer's renewal; a small pool made the stand-in itself
#: fall behind whenever the server answered slowly for a moment (at 1,000 runs a renewal is
#: due every 5 ms: 8 threads gave 40 ms a request before renewals queued).
RENEWALS_IN_FLIGHT = 32
#: A renewal's own deadline, as a trainer's Lease client has one (``lease_rest``): a request
#: the server never answers fails instead of holding its thread; the next renewal, already
#: scheduled, tries again.
RENEWAL_TIMEOUT_S = 10.0


def hollow_run(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "rolloutrun.dev/v1alpha1",
        "kind": "RolloutRun",
        "metadata": {"name": name},
        "spec": {
            "storage": {"uri": f"gs://bench-bucket/{name}"},
            "gym": {"replicas": 2, "nodeSelector": {"bench": HOLLOW}},
            "trainer": {"nodeSelector": {"bench": HOLLOW}},
            "recovery": {
                "maxRestarts": 10000,
                "backoffSeconds": 0,
                "leaseDurationSeconds": LEASE_DURATION_S,
            },
            "run": {"workers": {"backend": "inprocess"}},
        },
    }


def anchor_due(run: str, now: float) -> bool:
    """Whether a renewal at ``now`` records a new anchor step: once a minute, at the run's
    own phase (a trainer anchors on its own steps, not on the wall clock's minute), unless
    ``BENCH_ANCHOR_BURST`` puts every run's anchor in the first seconds of each minute (the
    earlier load generator: about a thousand status writes at once at 1,000 runs)."""
    phase = 0.0 if os.environ.get("BENCH_ANCHOR_BURST") else (zlib.crc32(run.encode()) % 60)
    window = LEASE_DURATION_S / 3
    return int((now - phase) // ANCHOR_EVERY_S) != int((now - phase - window) // ANCHOR_EVERY_S)


def set_lease_seconds(seconds: int) -> None:
    global LEASE_DURATION_S
    LEASE_DURATION_S = seconds
    os.environ["BENCH_LEASE_SECONDS"] = str(seconds)  # the hollow process renews as long


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parts(name: str) -> tuple[str, str, str]:
    """``(run, incarnation, role)`` of a member pod ``<run>-i<n>-<role>``."""
    run, _, rest = name.rpartition("-i")
    number, _, role = rest.partition("-")
    return run, number, role


def newer_version(version: str | None, event: dict[str, Any]) -> str | None:
    """The resourceVersion a re-opened watch resumes from after ``event`` (its ``raw_object``):
    the newest one seen, bookmarks included. Not simply the last event's: the initial
    ``ADDED`` events of a list come in name order, each with its own older version."""
    seen = str(((event.get("raw_object") or {}).get("metadata") or {}).get("resourceVersion"))
    if not seen.isdigit():
        return version
    return seen if version is None or int(seen) > int(version) else version


def _pod_events(core: Any, namespace: str, stop: threading.Event, reopen_s: int = 60) -> Any:
    """The hollow node's pods' watch events until ``stop`` (one watch a process: a kubelet
    watches the pods bound to its node), re-opened every ``reopen_s`` from the newest
    version seen, as a kubelet's informer does; listed again (every pod ``ADDED``) only
    when that version is gone (410). Re-listing at every re-open made the kubelet decode
    all 3,000 pods of 1,000 runs once a minute (~2 s under load) and a loss that came
    meanwhile waited behind them: the bench's largest kubelet parts."""
    from kubernetes import watch
    from kubernetes.client.rest import ApiException

    version: str | None = None
    while not stop.is_set():
        options: dict[str, Any] = {
            "field_selector": f"spec.nodeName={HOLLOW}",
            "timeout_seconds": reopen_s,
            "allow_watch_bookmarks": True,
        }
        if version is not None:
            options["resource_version"] = version
        else:  # the list ends with a bookmark of its own version: resume from that one
            options.update(send_initial_events=True, resource_version_match="NotOlderThan")
        try:
            for event in watch.Watch().stream(core.list_namespaced_pod, namespace, **options):
                version = newer_version(version, event)
                if stop.is_set():
                    return
                if event["type"] != "BOOKMARK":
                    yield event
        except ApiException as error:
            if error.status != 410:
                raise
            version = None  # compacted past it: list again


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_status(phase: str, ready: bool, now: str, state: dict[str, Any]) -> dict[str, Any]:
    """A one-container pod's status as a kubelet writes it (``state``: the container's)."""
    return {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": str(ready), "lastTransitionTime": now},
        ],
        "containerStatuses": [
            {
                "name": "main",
                "ready": ready,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": state,
            }
        ],
    }


def running_status(ip: str, now: str) -> dict[str, Any]:
    """What a kubelet writes once a pod's container started and its probe passed."""
    return {**_pod_status("Running", True, now, {"running": {"startedAt": now}}), "podIP": ip}


def terminated_status(now: str) -> dict[str, Any]:
    """What a kubelet writes once a deleted pod's container ended on its SIGTERM (a deleted
    pod is moved to a terminal phase before its deletion is finished, as kubelets do since
    Kubernetes 1.27)."""
    ended = {"exitCode": 143, "reason": "Error", "startedAt": now, "finishedAt": now}
    return _pod_status("Failed", False, now, {"terminated": ended})


class HollowKubelet:
    """The hollow node's kubelet, through the API (admin), in a process of its own
    (``--hollow NS --hollow-role kubelet``): with the trainers' renewals in the same process
    (~195 requests/s at 1,000 runs), its pod writes queued 2-5 s behind them; on a cluster
    each node's kubelet ends its own pods. What it writes is what a kubelet writes: a bound
    pod's Running and Ready status; for a deleted pod, its container terminated and the
    pod's terminal phase, then the deletion finished (grace period 0, as the kubelet's
    status manager does once the pod's resources are released)."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client as k8s

        self.core: Any = k8s.CoreV1Api(api)
        self.namespace = namespace
        self.pool = ThreadPoolExecutor(4)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._watch, daemon=True)]
        self.address = 0
        self.ending: set[str] = set()  # pods whose end is under way (one end each)

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        for event in _pod_events(self.core, self.namespace, self.stop):
            pod = event["object"]
            name = pod.metadata.name
            if event["type"] == "DELETED":
                self.ending.discard(name)
            elif pod.metadata.deletion_timestamp is not None:
                if name not in self.ending:
                    self.ending.add(name)
                    self.pool.submit(self._finish, name)
            elif pod.status.phase not in ("Running", "Failed", "Succeeded"):
                self.pool.submit(self._run, name)

    def _run(self, name: str) -> None:
        self.address += 1
        a = self.address
        ip = f"10.{(a >> 16) & 255}.{(a >> 8) & 255}.{a & 255}"
        body = {"status": running_status(ip, _now())}
        try:
            drained(
                self.core.patch_namespaced_pod_status(
                    name, self.namespace, body, _preload_content=False
                )
            )
        except Exception:  # deleted meanwhile
            return

    def _finish(self, name: str) -> None:
        try:
            drained(
                self.core.patch_namespaced_pod_status(
                    name,
                    self.namespace,
                    {"status": terminated_status(_now())},
                    _preload_content=False,
                )
            )
        except Exception:  # gone meanwhile: nothing left to end
            return
        try:
            drained(
                self.core.delete_namespaced_pod(
                    name, self.namespace, grace_period_seconds=0, _preload_content=False
                )
            )
        except Exception:
            return


class HollowTrainers:
    """The runs' trainers, through the API (admin), in a process of their own
    (``--hollow NS --hollow-role trainers``), apart from the hollow kubelet and from the
    API server. A trainer starts renewing its run's Lease once its pod runs (seen on its
    own watch, as a trainer starts once its container does) and stops when its pod is being
    deleted. Responses are not decoded (``_preload_content=False``), and each trainer renews
    on its own phase, ``duration/3`` after its last renewal, as trainers do, not all runs in
    one burst."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client as k8s

        self.core: Any = k8s.CoreV1Api(api)
        self.leases: Any = k8s.CoordinationV1Api(api)
        self.namespace = namespace
        self.renewers = ThreadPoolExecutor(RENEWALS_IN_FLIGHT)
        self.stop = threading.Event()
        self.trainers: dict[str, str] = {}  # run -> holder identity of its running trainer
        self.due: list[tuple[float, str, str]] = []  # (monotonic, run, holder): next renewals
        self.lock = threading.Lock()
        self.step = 0
        self.threads = [
            threading.Thread(target=self._watch, daemon=True),
            threading.Thread(target=self._trainers, daemon=True),
        ]

    def close(self) -> None:
        self.stop.set()
        self.renewers.shutdown(wait=False, cancel_futures=True)

    def _watch(self) -> None:
        for event in _pod_events(self.core, self.namespace, self.stop):
            pod = event["object"]
            run, number, role = _parts(pod.metadata.name)
            if role != "trainer":
                continue
            holder = f"{pod.metadata.name}/{number}"
            ended = event["type"] == "DELETED" or pod.metadata.deletion_timestamp is not None
            with self.lock:
                if ended:
                    if self.trainers.get(run) == holder:
                        del self.trainers[run]
                    continue
                if pod.status.phase != "Running" or self.trainers.get(run) == holder:
                    continue
                self.trainers[run] = holder  # one renewal chain per trainer
            self.renewers.submit(self._renew, run, holder)

    def _renew(self, run: str, holder: str) -> None:
        with self.lock:
            if self.trainers.get(run) != holder:
                return  # that trainer is gone: its successor renews on its own phase
            self.step += 1
            step = self.step
            heapq.heappush(self.due, (time.monotonic() + LEASE_DURATION_S / 3, run, holder))
        notes = {"rolloutrun.dev/train-step": str(step)}
        if anchor_due(run, time.time()):
            notes["rolloutrun.dev/anchor-step"] = str(step)
        spec = {
            "holderIdentity": holder,
            "renewTime": micro_now(),
            "leaseDurationSeconds": LEASE_DURATION_S,
        }
        body = {"metadata": {"annotations": notes}, "spec": spec}
        try:
            drained(
                self.leases.patch_namespaced_lease(
                    f"{run}-trainer",
                    self.namespace,
                    body,
                    _preload_content=False,
                    _request_timeout=RENEWAL_TIMEOUT_S,
                )
            )
        except Exception:
            return

    def _trainers(self) -> None:
        while not self.stop.wait(0.05):
            now = time.monotonic()
            with self.lock:
                ready = []
                while self.due and self.due[0][0] <= now:
                    ready.append(heapq.heappop(self.due))
            for _at, run, holder in ready:
                self.renewers.submit(self._renew, run, holder)


ROLES: dict[str, type[HollowKubelet] | type[HollowTrainers]] = {
    "kubelet": HollowKubelet,
    "trainers": HollowTrainers,
}


def hollow_main(kubeconfig: str, namespace: str, role: str) -> int:
    """``--hollow NS --hollow-role ROLE``: the hollow kubelet or the trainers until SIGTERM
    (``bench.operator_scale.start_hollow`` starts one process of each)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    # A kept connection per request in flight (and the watch): urllib3 discards what its
    # pool cannot keep, and each renewal would then pay a TLS handshake.
    configuration.connection_pool_maxsize = RENEWALS_IN_FLIGHT + 2
    hollow = ROLES[role](client.ApiClient(configuration), namespace)
    signal.signal(signal.SIGTERM, lambda *_: hollow.stop.set())
    for thread in hollow.threads:
        thread.start()
    # Paced as the operator and the API server are: CPython's automatic full passes over
    # the client's heap stopped the kubelet's process 0.5-1.8 s under load (a Go kubelet
    # has no such pauses): everything alive is frozen every 30 s instead.
    asyncio.run(with_paced_gc(asyncio.to_thread(hollow.stop.wait)))
    hollow.close()
    return 0

"""The hollow node's kubelet and the runs' trainers of ``bench.operator_scale``.

Why a module of its own: it runs in a process of its own (``python -m bench.operator_scale
--hollow NAMESPACE``), so it does not share the benchmark's interpreter lock with the API
server, and the benchmark stays readable.
"""

from __future__ import annotations

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

HOLLOW = "hollow"
#: The runs' ``leaseDurationSeconds`` (``--lease-seconds``): trainers renew every third of it.
LEASE_DURATION_S = 15
ANCHOR_EVERY_S = 60.0


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


class Hollow:
    """The hollow node's kubelet and the runs' trainers, through the API (admin).

    Run in a process of its own (:func:`start_hollow`): in the benchmark's process it shared
    the interpreter lock with the API server, whose requests then queued behind the load
    generator's (tens of seconds at 200 runs: the replacement times measured the generator,
    not the operator). Responses are not decoded (``_preload_content=False``), and each
    trainer renews on its own phase, ``duration/3`` after its last renewal, as trainers do,
    not all runs in one burst."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client as k8s

        self.core: Any = k8s.CoreV1Api(api)
        self.leases: Any = k8s.CoordinationV1Api(api)
        self.namespace = namespace
        self.pool = ThreadPoolExecutor(4)  # the kubelet's
        self.renewers = ThreadPoolExecutor(8)  # the trainers'

        self.stop = threading.Event()
        self.trainers: dict[str, str] = {}  # run -> holder identity of its running trainer
        self.due: list[tuple[float, str, str]] = []  # (monotonic, run, holder): next renewals
        self.lock = threading.Lock()
        self.step = 0
        self.threads = [
            threading.Thread(target=self._kubelet, daemon=True),
            threading.Thread(target=self._trainers, daemon=True),
        ]
        self.address = 0

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.renewers.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- the hollow kubelet
    def _kubelet(self) -> None:
        from kubernetes import watch

        while not self.stop.is_set():
            stream = watch.Watch().stream(
                self.core.list_namespaced_pod,
                self.namespace,
                field_selector=f"spec.nodeName={HOLLOW}",
                timeout_seconds=60,
            )
            for event in stream:
                if self.stop.is_set():
                    return
                pod = event["object"]
                if event["type"] == "DELETED":
                    self._gone(pod)
                elif pod.metadata.deletion_timestamp is not None:
                    self.pool.submit(self._finish, pod.metadata.name)
                elif pod.status.phase != "Running":
                    self.pool.submit(self._run, pod.metadata.name)

    def _run(self, name: str) -> None:
        self.address += 1
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ip = f"10.{(self.address >> 16) & 255}.{(self.address >> 8) & 255}.{self.address & 255}"
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True", "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": "main",
                    "ready": True,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
            ],
        }
        try:
            drained(
                self.core.patch_namespaced_pod_status(
                    name, self.namespace, {"status": status}, _preload_content=False
                )
            )
        except Exception:  # deleted meanwhile
            return
        run, _, rest = name.rpartition("-i")
        number, _, role = rest.partition("-")
        if role == "trainer":
            holder = f"{name}/{number}"
            with self.lock:
                new = self.trainers.get(run) != holder  # one renewal chain per trainer
                self.trainers[run] = holder
            if new:
                self.renewers.submit(self._renew, run, holder)

    def _finish(self, name: str) -> None:
        try:
            drained(
                self.core.delete_namespaced_pod(
                    name, self.namespace, grace_period_seconds=0, _preload_content=False
                )
            )
        except Exception:
            return

    def _gone(self, pod: Any) -> None:
        run, _, rest = pod.metadata.name.rpartition("-i")
        number, _, role = rest.partition("-")
        if role == "trainer":
            with self.lock:
                if self.trainers.get(run) == f"{pod.metadata.name}/{number}":
                    del self.trainers[run]

    # ---------------------------------------------------------------- the trainers
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
                    f"{run}-trainer", self.namespace, body, _preload_content=False
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


def hollow_main(kubeconfig: str, namespace: str) -> int:
    """``--hollow``: the hollow kubelet and trainers until SIGTERM (:func:`start_hollow`)."""
    from kubernetes import config

    hollow = Hollow(config.new_client_from_config(config_file=kubeconfig), namespace)
    signal.signal(signal.SIGTERM, lambda *_: hollow.stop.set())
    for thread in hollow.threads:
        thread.start()
    hollow.stop.wait()
    hollow.close()
    return 0

"""Per-pod CPU of a local-cluster run, sampled from ``/proc``: where a worker deletion's cost
goes (issue 14).

Why: with a worker pod deleted every 15 s the worker arms train ~20 % fewer steps than
undisturbed, although a ready standby takes over in a fraction of a second; the machine's
cores are shared by the trainer, the Gyms, the active workers and the pod refilling the
standby pool. Which of them spends the CPU in the seconds after each deletion is read per
process (``utime + stime`` of ``/proc/<pid>/stat``, the processes of each pod's CPU cgroup,
:mod:`rolloutrun_localcluster.cpucontrol`), summed per pod, then per kind of pod in each
deletion's interval (:func:`cpu_after_deletions`, pure) against the same span's share
before the first deletion. This process (API server, operator, kubelet and the bench's own
polls, one process) is read too; the machine's busy CPU is from ``/proc/stat``. A process
that ends between two samples loses its last interval; one that lived less than a period
is not seen. Without CPU cgroups (``cpu-control: off``) only this process and the machine
are read.

Per process too (:func:`process_label`, by command line): the trainer pod holds Ray's head
(GCS, raylet, Ray's agents, the log monitor) beside the trainer, and a refill pod its node,
agents and actor; :func:`processes_after_deletions` splits those pods' CPU per process in
each deletion's interval against the same span before, to tell the head's reaction to a
node's death and a new node's registration from the trainer's own work.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .worker_start_cpu import cmdline_of, label

#: Seconds between two samples.
SAMPLE_S = 0.25
#: The local cluster's pod cgroups (cgroup v1 ``cpu``: in a node's cgroup or its QoS tier's).
POD_CGROUPS = (
    "/sys/fs/cgroup/cpu/rolloutrun-localcluster-*/pod{uid}",
    "/sys/fs/cgroup/cpu/rolloutrun-localcluster-*/*/pod{uid}",
)
#: Names of the CPU's consumers that are not pods.
THIS_PROCESS, MACHINE = "bench_process", "machine_busy"
_HZ = os.sysconf("SC_CLK_TCK")
#: Processes of Ray's head (the trainer pod), by what their command line holds; the rest
#: by :func:`bench.worker_start_cpu.label` (a node's agents, workers and actors).
HEAD_LABELS = (
    ("gcs_server", "gcs_server"),
    ("log_monitor", "log_monitor.py"),
    ("autoscaler_monitor", "autoscaler/_private/monitor.py"),
    ("dashboard", "dashboard/dashboard.py"),
    ("ray_client_server", "ray.util.client.server"),
    ("lease_keeper", "rolloutrun_runtime.lease_keeper"),
    ("trainer", "rolloutrun trainer"),
    ("trainer", "rolloutrun_runtime.cli trainer"),
)
#: Pods whose processes are split: the trainer's (Ray's head) and the refill's.
SPLIT_ROLES = ("-trainer", "-worker-")


def process_label(cmdline: str) -> str:
    """A pod process's kind by its command line: a Ray node's by
    :func:`bench.worker_start_cpu.label`, then Ray's head processes and the trainer pod's
    own (:data:`HEAD_LABELS`)."""
    kind = label(cmdline)
    if kind != "other":
        return kind
    for name, marker in HEAD_LABELS:
        if marker in cmdline:
            return name
    return "other"


def _cpu_s(stat_path: str) -> float | None:
    try:
        with open(stat_path) as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def _machine_busy_s() -> float:
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / _HZ


class PodCpuSampler(threading.Thread):
    """Every :data:`SAMPLE_S`: per pod uid (``pods()``: uid -> name), the CPU its processes
    spent since the last sample; rows ``(time, uid or THIS_PROCESS or MACHINE, cpu_s)``;
    for the pods of :data:`SPLIT_ROLES` also ``process_rows`` ``(time, uid, label, cpu_s)``
    (:func:`process_label`)."""

    def __init__(self, pods: Callable[[], dict[str, str]]) -> None:
        super().__init__(daemon=True, name="pod-cpu")
        self.pods = pods
        self.names: dict[str, str] = {}
        self.rows: list[tuple[float, str, float]] = []
        self.process_rows: list[tuple[float, str, str, float]] = []
        self.stopped = threading.Event()
        self._last: dict[object, float] = {}
        self._paths: dict[str, str] = {}
        self._gone: set[str] = set()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)

    def _delta(self, key: object, now_s: float | None, primed: bool) -> float:
        if now_s is None:
            return 0.0
        before = self._last.get(key)
        self._last[key] = now_s
        if before is None:  # there at the first sample: from now; born since: all of it
            return 0.0 if not primed else now_s
        return max(0.0, now_s - before)

    def _pod_pids(self, uid: str) -> list[int]:
        path = self._paths.get(uid)
        if path is None:
            found = [hit for pattern in POD_CGROUPS for hit in glob.glob(pattern.format(uid=uid))]
            if not found:
                return []
            path = self._paths[uid] = found[0]
        try:
            with open(os.path.join(path, "cgroup.procs")) as handle:
                return [int(pid) for pid in handle.read().split()]
        except OSError:  # the pod and its cgroup are gone
            self._gone.add(uid)
            return []

    def _sample_pod(self, now: float, uid: str, primed: bool) -> None:
        split = any(role in self.names.get(uid, "") for role in SPLIT_ROLES)
        per: dict[str, float] = {}
        for pid in self._pod_pids(uid):
            spent = self._delta(pid, _cpu_s(f"/proc/{pid}/stat"), primed)
            if spent:
                kind = process_label(cmdline_of(pid)) if split else ""
                per[kind] = per.get(kind, 0.0) + spent
        if per:
            self.rows.append((now, uid, sum(per.values())))
        if split:
            self.process_rows.extend((now, uid, kind, spent) for kind, spent in per.items())

    def run(self) -> None:
        primed, polls = False, 0
        while not self.stopped.is_set():
            if polls % 8 == 0:  # every 2 s: a new pod's CPU since its birth is counted
                try:
                    self.names.update(self.pods())
                except Exception:  # a busy API server: the next poll
                    pass
            polls += 1
            now = time.time()
            for uid in [uid for uid in self.names if uid not in self._gone]:
                self._sample_pod(now, uid, primed)
            tasks = os.listdir("/proc/self/task")
            mine = sum(
                self._delta(("task", t), _cpu_s(f"/proc/self/task/{t}/stat"), primed) for t in tasks
            )
            self.rows.append((now, THIS_PROCESS, mine))
            self.rows.append((now, MACHINE, self._delta(MACHINE, _machine_busy_s(), primed)))
            primed = True
            time.sleep(SAMPLE_S)


def pod_kind(name: str, uid: str, victim: str, refill: str | None) -> str:
    """What a pod was to one deletion: the ``refill`` (the deleted pod's replacement), the
    ``deleted`` pod itself, else its role (``trainer``, ``gym``, ``worker``) by name."""
    if uid == refill:
        return "refill"
    if name == victim:
        return "deleted"
    for role in ("trainer", "gym", "worker"):
        if f"-{role}" in name:
            return role
    return name


def cpu_after_deletions(
    rows: Iterable[tuple[float, str, float]],
    names: dict[str, str],
    deletions: list[tuple[float, str, str | None]],
    span: float,
    start: float,
) -> dict[str, Any]:
    """Per deletion ``(at, victim pod, refill uid)``: CPU-seconds by kind (:func:`pod_kind`,
    :data:`THIS_PROCESS`, :data:`MACHINE`) in ``[at, at + span)``; and the same kinds'
    CPU per ``span`` before the first deletion (from ``start``; without a deletion, over
    every row)."""
    rows = list(rows)

    def kinds(lo: float, hi: float, victim: str, refill: str | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, key, spent in rows:
            if lo <= t < hi:
                kind = key if key in (THIS_PROCESS, MACHINE) else (
                    pod_kind(names.get(key, key), key, victim, refill)
                )  # fmt: skip
                out[kind] = out.get(kind, 0.0) + spent
        return {kind: round(value, 2) for kind, value in sorted(out.items())}

    last = max((t for t, _, _ in rows), default=start)
    first = min((at for at, _, _ in deletions), default=last)  # none: the whole sample
    before: dict[str, float] = {}
    if first - start >= 1.0:
        whole = kinds(start, first, "", None)
        before = {k: round(v * span / (first - start), 2) for k, v in whole.items()}
    return {
        "span_s": span,
        "before_per_span": before,
        "after_each": [kinds(at, at + span, victim, refill) for at, victim, refill in deletions],
    }


def processes_after_deletions(
    rows: Iterable[tuple[float, str, str, float]],
    names: dict[str, str],
    deletions: list[tuple[float, str, str | None]],
    span: float,
    start: float,
) -> dict[str, Any]:
    """Per deletion ``(at, victim pod, refill uid)``: the trainer pod's CPU-seconds per
    process label in ``[at, at + span)``, and the refill pod's; the trainer's per ``span``
    before the first deletion (from ``start``; without a deletion, over every row)."""
    rows = list(rows)

    trainer: set[str | None] = {uid for uid, name in names.items() if "-trainer" in name}

    def of(lo: float, hi: float, uids: set[str | None]) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, uid, kind, spent in rows:
            if lo <= t < hi and uid in uids:
                out[kind] = out.get(kind, 0.0) + spent
        return {kind: round(value, 2) for kind, value in sorted(out.items())}

    last = max((t for t, _, _, _ in rows), default=start)
    first = min((at for at, _, _ in deletions), default=last)
    before: dict[str, float] = {}
    if first - start >= 1.0:
        whole = of(start, first, trainer)
        before = {k: round(v * span / (first - start), 2) for k, v in whole.items()}
    return {
        "span_s": span,
        "trainer_before_per_span": before,
        "trainer_after_each": [of(at, at + span, trainer) for at, _, _ in deletions],
        "refill_after_each": [of(at, at + span, {refill}) for at, _, refill in deletions],
    }

"""Each pod's processes in a CPU cgroup, as a kubelet puts them: shares from requests, quota
from limits.

Why: without it the process kubelet's pods get the CPU by how many processes they run. A
pod that starts many at once (a Ray worker node: raylet, its Python workers, an actor
importing torch) takes most of a small machine from a trainer that runs one, which no real
node allows: there each pod is a cgroup whose ``cpu.shares`` come from its CPU request
(a BestEffort pod gets 2) and whose CFS quota comes from its CPU limit.

The layout is the kubelet's ``--cgroups-per-qos`` one on cgroup v1 (the ``cpu`` controller),
under one node cgroup (``kubepods``; shares from the node's CPUs): Guaranteed pods directly
in it, Burstable pods under ``burstable`` (shares: the sum of its pods' requests), BestEffort
pods under ``besteffort`` (2 shares). Pod level: shares from the sum of the containers'
requests (an init container's larger request counts), quota from the sum of their limits
when every container has one. A container's main process joins its pod's cgroup before it
runs the container's command (:meth:`CpuControl.launcher_prefix`), so everything it forks
stays there; the pod's cgroup is removed when its processes are gone.

Where the cpu controller is not there or not writable (cgroup v2 only, no root, a read-only
``/sys/fs/cgroup``) the cluster runs as before, without CPU control: :func:`open_control`
says why once in the log, and the node's annotation :data:`CPU_CONTROL_ANNOTATION` says it to
anyone who looks at the node (``off: <why>``). The quantities and the layout are pure
functions; the file writes are the thin part at the edge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import math
import os
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Obj = dict[str, Any]

#: Where cgroup v1 mounts the cpu controller; ``$ROLLOUTRUN_LOCALCLUSTER_CPU_CGROUP`` moves it
#: (``off``: no CPU control).
CPU_CGROUP_ROOT = "/sys/fs/cgroup/cpu"
ENV_CPU_CGROUP = "ROLLOUTRUN_LOCALCLUSTER_CPU_CGROUP"
CPU_CONTROL_ANNOTATION = "localcluster.rolloutrun.dev/cpu-control"
#: The kubelet's constants (``MilliCPUToShares``, ``MilliCPUToQuota``): the CFS period,
#: the shares' bounds, the smallest quota.
PERIOD_US = 100_000
MIN_SHARES, MAX_SHARES, SHARES_PER_CPU = 2, 262_144, 1024
MIN_QUOTA_US = 1000
GUARANTEED, BURSTABLE, BEST_EFFORT = "Guaranteed", "Burstable", "BestEffort"
#: The QoS tiers' cgroups under the node's (Guaranteed pods sit in the node's own).
TIER_DIRS = {BURSTABLE: "burstable", BEST_EFFORT: "besteffort"}


# ---------------------------------------------------------------- quantities (pure)
def cpu_millis(quantity: Any) -> int:
    """A CPU quantity (``"250m"``, ``"0.5"``, ``2``) in millicores, rounded up as the API's
    ``MilliValue`` does. An unreadable one counts 0 (admission rejects it on a real API)."""
    text = str(quantity).strip()
    scale = Decimal(1)
    if text.endswith("m"):
        text, scale = text[:-1], Decimal("0.001")
    try:
        return max(0, math.ceil(Decimal(text) * scale * 1000))
    except (InvalidOperation, ValueError):
        return 0


def shares_of(millis: int) -> int:
    """``cpu.shares`` for a request of ``millis`` (the kubelet's ``MilliCPUToShares``)."""
    return min(MAX_SHARES, max(MIN_SHARES, millis * SHARES_PER_CPU // 1000))


def quota_of(millis: int) -> int:
    """``cpu.cfs_quota_us`` per :data:`PERIOD_US` for a limit of ``millis``."""
    return max(MIN_QUOTA_US, millis * PERIOD_US // 1000)


def _amounts(container: Obj, resource: str) -> tuple[str | None, str | None]:
    """A container's (request, limit) of ``resource``; the request defaults to the limit, as
    the API server's defaulting sets it."""
    resources = container.get("resources") or {}
    limit = (resources.get("limits") or {}).get(resource)
    request = (resources.get("requests") or {}).get(resource, limit)
    return (None if request is None else str(request), None if limit is None else str(limit))


def _containers(spec: Obj) -> list[Obj]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def qos_class(spec: Obj) -> str:
    """The pod's QoS class: Guaranteed when every container's CPU and memory limits are set
    and equal to its requests, BestEffort when no container asks for either, else Burstable."""
    containers = _containers(spec)
    amounts = [(r, *_amounts(c, r)) for c in containers for r in ("cpu", "memory")]
    if not any(request or limit for _, request, limit in amounts):
        return BEST_EFFORT
    guaranteed = all(
        limit is not None and request is not None and _same(request, limit, resource)
        for resource, request, limit in amounts
    )
    return GUARANTEED if containers and guaranteed else BURSTABLE


def _same(request: str, limit: str, resource: str) -> bool:
    if resource == "cpu":
        return cpu_millis(request) == cpu_millis(limit)
    return request == limit


@dataclasses.dataclass(frozen=True)
class PodCpu:
    """What the pod's cgroup gets: its QoS tier, ``cpu.shares``, request and quota (None:
    unlimited)."""

    qos: str
    request_millis: int
    shares: int
    quota_us: int | None


def pod_cpu(spec: Obj) -> PodCpu:
    """The pod cgroup's settings from its containers (the kubelet's ``ResourceConfigForPod``):
    requests summed over the containers, or an init container's if larger (they run one at a
    time, before them); a quota only when every container has a CPU limit."""
    main = list(spec.get("containers") or [])
    init = list(spec.get("initContainers") or [])

    def millis(c: Obj) -> tuple[int, int | None]:
        request, limit = _amounts(c, "cpu")
        return cpu_millis(request or 0), None if limit is None else cpu_millis(limit)

    main_cpu, init_cpu = [millis(c) for c in main], [millis(c) for c in init]
    requested = max([sum(r for r, _ in main_cpu), *(r for r, _ in init_cpu)])
    limits = [limit for _, limit in [*main_cpu, *init_cpu]]
    quota = None
    if limits and all(limit is not None for limit in limits):
        main_total = sum(limit or 0 for _, limit in main_cpu)
        quota = quota_of(max([main_total, *(limit or 0 for _, limit in init_cpu)]))
    qos = qos_class(spec)
    shares = MIN_SHARES if qos == BEST_EFFORT else shares_of(requested)
    return PodCpu(qos, requested, shares, quota)


def burstable_shares(pods: Iterable[PodCpu]) -> int:
    """The Burstable tier's shares: its pods' requests together (the kubelet's QoS manager)."""
    return shares_of(sum(p.request_millis for p in pods if p.qos == BURSTABLE))


def node_cgroup_name(cluster_dir: str, node: str) -> str:
    """The node's cgroup, one per cluster directory and node (clusters side by side)."""
    digest = hashlib.sha256(cluster_dir.encode()).hexdigest()[:10]
    return f"rolloutrun-localcluster-{node}-{digest}"


def pod_cgroup_path(node_dir: Path, uid: str, qos: str) -> Path:
    tier = TIER_DIRS.get(qos)
    parent = node_dir / tier if tier else node_dir
    return parent / f"pod{uid}"


# ---------------------------------------------------------------- the cgroup files (I/O)
def _write(path: Path, value: object) -> None:
    with open(path, "w") as handle:
        handle.write(str(value))


def _pids(directory: Path) -> set[int]:
    try:
        return {int(line) for line in (directory / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def _remove_tree(directory: Path, parking: Path) -> bool:
    """Remove ``directory`` and the cgroups under it, moving any process still there to
    ``parking`` first; whether it is gone."""
    if not directory.is_dir():
        return True
    for child in [c for c in directory.iterdir() if c.is_dir()]:
        _remove_tree(child, parking)
    for pid in _pids(directory):
        with contextlib.suppress(OSError):
            _write(parking / "cgroup.procs", pid)
    try:
        directory.rmdir()
        return True
    except OSError:
        return False


class CpuControl:
    """The node's cgroup and its pods' (cgroup v1, ``cpu`` controller)."""

    def __init__(self, root: Path, node_dir: Path, capacity_millis: int) -> None:
        self.root = root
        self.node_dir = node_dir
        self.capacity_millis = capacity_millis
        self.pods: dict[str, tuple[Path, PodCpu]] = {}

    def describe(self) -> str:
        return f"cgroup v1 {self.node_dir}"

    def setup(self) -> None:
        """The node's cgroup and its tiers, fresh (an earlier run's are removed)."""
        _remove_tree(self.node_dir, self.root)
        self.node_dir.mkdir()
        _write(self.node_dir / "cpu.shares", shares_of(self.capacity_millis))
        for tier in TIER_DIRS.values():
            (self.node_dir / tier).mkdir()
        self._set_tiers()

    def _set_tiers(self) -> None:
        _write(self.node_dir / TIER_DIRS[BEST_EFFORT] / "cpu.shares", MIN_SHARES)
        shares = burstable_shares(cpu for _, cpu in self.pods.values())
        _write(self.node_dir / TIER_DIRS[BURSTABLE] / "cpu.shares", shares)

    def add_pod(self, uid: str, spec: Obj) -> Path:
        """The pod's cgroup with its shares and quota; its path."""
        cpu = pod_cpu(spec)
        path = pod_cgroup_path(self.node_dir, uid, cpu.qos)
        path.mkdir(exist_ok=True)
        _write(path / "cpu.cfs_period_us", PERIOD_US)
        _write(path / "cpu.shares", cpu.shares)
        _write(path / "cpu.cfs_quota_us", -1 if cpu.quota_us is None else cpu.quota_us)
        self.pods[uid] = (path, cpu)
        self._set_tiers()
        return path

    def launcher_prefix(self, uid: str) -> list[str]:
        """An argv prefix that moves the container's process into the pod's cgroup, then
        runs the rest in its place (same pid, so its session and signals are as before)."""
        entry = self.pods.get(uid)
        if entry is None:
            return []
        procs = str(entry[0] / "cgroup.procs")
        return ["/bin/sh", "-c", '{ echo $$ > "$0"; } 2>/dev/null; exec "$@"', procs]

    def pids(self, uid: str) -> set[int]:
        """The processes in the pod's cgroup (what its containers started, however they
        daemonized)."""
        entry = self.pods.get(uid)
        return _pids(entry[0]) if entry else set()

    def remove_pod(self, uid: str) -> bool:
        """Remove the pod's cgroup once its processes are gone; whether it is gone (an
        ``EBUSY`` while the last ones exit: call again)."""
        entry = self.pods.get(uid)
        if entry is None:
            return True
        try:
            entry[0].rmdir()
        except FileNotFoundError:
            pass
        except OSError as error:
            if error.errno == errno.EBUSY:
                return False
            raise
        del self.pods[uid]
        with contextlib.suppress(OSError):
            self._set_tiers()
        return True

    def close(self) -> None:
        """Remove the node's cgroups (processes still there go back to the root's)."""
        if not _remove_tree(self.node_dir, self.root):
            logger.warning("could not remove the node's cgroup %s", self.node_dir)
        self.pods.clear()


def open_control(
    cluster_dir: str, node: str, capacity_millis: int, environ: Mapping[str, str] = os.environ
) -> CpuControl | str:
    """The node's CPU control, or why there is none (logged once here)."""
    root = Path(environ.get(ENV_CPU_CGROUP) or CPU_CGROUP_ROOT)
    why = None
    if str(root) == "off":
        why = f"turned off by ${ENV_CPU_CGROUP}"
    elif not (root / "cpu.shares").is_file() or not (root / "cpu.cfs_quota_us").is_file():
        why = f"no cgroup v1 cpu controller at {root}"
    if why is None:
        control = CpuControl(root, root / node_cgroup_name(cluster_dir, node), capacity_millis)
        try:
            control.setup()
            return control
        except OSError as error:
            why = f"cannot create cgroups under {root}: {error.strerror or error}"
            with contextlib.suppress(OSError):
                control.close()
    logger.warning(
        "node %s runs pods without CPU control (requests and limits not enforced): %s", node, why
    )
    return f"off: {why}"

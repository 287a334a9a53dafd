"""The process kubelet of node ``local``: binds pods, runs them as processes, plays node loss.

It is also the scheduler (every pod without a node is bound to ``local`` while the node is
Ready) and the node lifecycle controller (a lost node turns ``Ready=Unknown``, its pods
``Ready=False``). It reads the store directly on the cluster's loop; what it writes goes
through the same store calls an API client's writes do, so watches see every change.

Each pod gets its own loopback address ``127.0.0.N`` as its pod IP (the whole 127/8 is
local on Linux), so pods reach each other by pod IP like on a flat pod network. That is the
``loopback`` pod network; in ``namespaces`` mode (:mod:`.netns`) the addresses are on a
bridge and each pod runs in its own network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.pod import ENV_LOCALCLUSTER_ROOT, ENV_POD_IP

from . import cpucontrol, errors, images, mountns, podspec
from .netns import LoopbackNetwork, PodNetwork
from .podworker import PodWorker
from .processes import CLUSTER_TAG, POD_TAG
from .resources import Registry, ResourceType
from .store import Event, Store, now_iso
from .tasks import TaskSet
from .volumes import Volumes

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
# What pods inherit from the cluster's own environment (everything else is the pod spec's).
INHERITED_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TZ",
    "TMPDIR",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "USER",
)


def pod_path(path: str) -> str:
    """The cluster's PATH with the running interpreter's ``bin`` first, so console scripts
    of the environment the cluster runs in (``rolloutrun``) resolve without activating it."""
    bin_dir = os.path.dirname(sys.executable)
    parts = [p for p in path.split(os.pathsep) if p]
    return os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])


class IpPool:
    """Loopback pod IPs from one /16 of 127.0.0.0/8, not reused until they wrap.

    The default network is ``127.0.0.0/16`` (pod IPs ``127.0.0.2``, ``127.0.0.3``, ...);
    clusters that run side by side on one machine (parallel test sessions) pass different
    networks so that their pods' addresses, and so their ports, never collide."""

    def __init__(self, network: str = "127.0.0.0/16", *, loopback: bool = True) -> None:
        net = ipaddress.IPv4Network(network)
        if loopback and not net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
            raise ValueError(f"pod network {network} is not loopback (127.0.0.0/8)")
        self._first = int(net.network_address) + 2
        self._last = int(net.broadcast_address) - 1
        self._next = self._first
        self._used: set[str] = set()

    def take(self) -> str:
        for _ in range(self._last - self._first + 1):
            candidate = str(ipaddress.IPv4Address(self._next))
            self._next = self._next + 1 if self._next < self._last else self._first
            if candidate.endswith((".0", ".255")) or candidate in self._used:
                continue
            self._used.add(candidate)
            return candidate
        raise RuntimeError("no pod IPs left")

    def give_back(self, ip: str) -> None:
        self._used.discard(ip)


def free_pod_network() -> str:
    """A random loopback /16 (``127.X.0.0/16``, X in 16..239) for one cluster, so that
    clusters running side by side (test sessions, ``rolloutrun run``) give their pods
    distinct IPs."""
    return f"127.{random.randint(16, 239)}.0.0/16"


class Kubelet:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        root: Path,
        *,
        token: str,
        account_token: Callable[[Obj], str] | None = None,
        kubeconfig_for: Callable[[str, str | None], str],
        ca_pem: bytes,
        api_port: Callable[[], int],
        node_name: str = "local",
        ips: IpPool | None = None,
        extra_env: dict[str, str] | None = None,
        backoff: tuple[float, float] = podspec.RESTART_BACKOFF,
        image_backoff: tuple[float, float] = images.IMAGE_BACKOFF,
        registry_images: images.Images | None = None,
        min_probe_period: float = 1.0,
        isolation: str = mountns.LOOPBACK,
        network: PodNetwork | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.root = root
        self.token = token
        self.account_token = account_token
        self.kubeconfig_for = kubeconfig_for
        self.ca_pem = ca_pem
        self.api_port = api_port
        self.node_name = node_name
        self.host_ip = "127.0.0.1"
        self.extra_env = dict(extra_env or {})
        self.backoff = backoff
        self.image_backoff = image_backoff
        self.images = registry_images or images.Images()
        self.min_probe_period = min_probe_period
        self.isolation = isolation  # mountns.NAMESPACES or LOOPBACK
        self.volumes = Volumes(self)
        self.workers: dict[str, PodWorker] = {}
        self.lost: str | None = None
        self._ips = ips or IpPool()
        self.network: PodNetwork = network or LoopbackNetwork("127.0.0.0/16")
        # Per-pod CPU cgroups (:mod:`.cpucontrol`), or why there are none: set at start.
        self.cpu: cpucontrol.CpuControl | None = None
        self.cpu_note = "off: not started"
        self._node_up = asyncio.Event()
        self._node_up.set()
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._terminations: dict[str, asyncio.Task[None]] = {}
        # Every worker and termination task, forgotten workers' included: stop awaits each.
        self.tasks = TaskSet()
        store.subscribe(self._on_event)

    # ------------------------------------------------------------------ helpers
    def _type(self, plural: str) -> ResourceType:
        rtype = self.registry.get("", "v1", plural)
        assert rtype is not None
        return rtype

    def pod(self, uid: str) -> Obj | None:
        return self.store.by_uid(uid)

    def lookup(self, plural: str) -> Callable[[str, str], Obj | None]:
        rtype = self._type(plural)
        return lambda namespace, name: self.store.find(rtype, namespace, name)

    def token_for(self, pod: Obj) -> str | None:
        """The token this pod gets, ``None`` if it opted out (pod or ServiceAccount): its
        ServiceAccount's own (``account_token``; none if the account does not exist)."""
        meta = pod.get("metadata") or {}
        name = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        account = self.lookup("serviceaccounts")(meta.get("namespace", ""), name)
        if not podspec.mounts_token(pod, account):
            return None
        if self.account_token is None:
            return self.token
        return None if account is None else self.account_token(account)

    def base_env(self, worker: PodWorker, container: Obj) -> dict[str, str]:
        env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        env["PATH"] = pod_path(env.get("PATH", ""))
        env.update(self.extra_env)
        port = str(self.api_port())
        env.update(
            {
                "HOSTNAME": worker.name,
                # Kinder than a real kubelet, which leaves this to the downward API (as the
                # operator's pods ask for it): kept for the local cluster's own test pods.
                ENV_POD_IP: worker.ip,
                "KUBERNETES_SERVICE_HOST": self.host_ip,
                "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_PORT": f"tcp://{self.host_ip}:{port}",
                "KUBECONFIG": str(worker.dir / "kubeconfig"),
                "ROLLOUTRUN_LOCALCLUSTER_POD_DIR": str(worker.dir),
                POD_TAG: worker.uid,
                CLUSTER_TAG: str(self.root),
            }
        )
        if self.isolation == mountns.LOOPBACK:  # no mount namespace: volumes under this root
            env[ENV_LOCALCLUSTER_ROOT] = str(worker.dir / "root")
        return env

    async def node_up(self) -> None:
        """Wait while the node is lost (a lost node's kubelet reports nothing)."""
        await self._node_up.wait()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        control = cpucontrol.open_control(
            str(self.root), self.node_name, 1000 * (os.cpu_count() or 1)
        )
        if isinstance(control, str):
            self.cpu_note = control
        else:
            self.cpu, self.cpu_note = control, control.describe()
        self._write_node()
        self._dirty.update(p["metadata"]["uid"] for p in self.store.objects("pods"))
        self._wake.set()
        self._task = asyncio.create_task(self._loop(), name="localcluster-kubelet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._node_up.set()
        try:
            for worker in self.workers.values():
                worker.freeze(False)
                worker.kill()
        finally:
            await self.tasks.cancel_all()
        for worker in self.workers.values():
            worker.kill()
        if self.cpu is not None:
            self.cpu.close()

    # ------------------------------------------------------------------ CPU cgroups
    def cpu_admit(self, worker: PodWorker, spec: Obj) -> None:
        """The pod's CPU cgroup; a pod whose cgroup cannot be made runs without one."""
        if self.cpu is None:
            return
        try:
            self.cpu.add_pod(worker.uid, spec)
        except OSError as error:
            logger.warning(
                "pod %s/%s runs without its CPU cgroup: %s", worker.namespace, worker.name, error
            )

    def cpu_prefix(self, uid: str) -> list[str]:
        return [] if self.cpu is None else self.cpu.launcher_prefix(uid)

    def cpu_pids(self, uid: str) -> set[int]:
        return set() if self.cpu is None else self.cpu.pids(uid)

    async def cpu_release(self, uid: str, bound: float = 5.0) -> None:
        """Remove the pod's cgroup once its (killed) processes have exited."""
        if self.cpu is None:
            return
        deadline = asyncio.get_running_loop().time() + bound
        while not self.cpu.remove_pod(uid):
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("the CPU cgroup of pod %s still holds processes", uid)
                return
            await asyncio.sleep(0.02)

    def _on_event(self, event: Event) -> None:
        if event.storage_key == "pods":
            self._dirty.add(event.obj["metadata"]["uid"])
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.lost:
                continue
            dirty, self._dirty = self._dirty, set()
            for uid in sorted(dirty):
                try:
                    self._sync(uid)
                except Exception:
                    logger.exception("kubelet failed to sync pod %s", uid)

    def _sync(self, uid: str) -> None:
        pod = self.store.by_uid(uid)
        worker = self.workers.get(uid)
        if pod is None:
            if worker is not None:
                worker.kill()  # removed from the API (force deletion): nothing waits for it
                self._forget(worker)
            return
        spec, meta = pod.get("spec") or {}, pod["metadata"]
        deleting = bool(meta.get("deletionTimestamp"))
        node = spec.get("nodeName")
        if node != self.node_name:
            return  # unbound (the scheduler's) or another node's
        terminal = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if worker is None and not deleting and not terminal:
            worker = PodWorker(self, pod, self._ips.take())
            self.workers[uid] = worker
            logger.info("starting pod %s/%s at %s", worker.namespace, worker.name, worker.ip)
            worker.start()
            if worker.task is not None:
                self.tasks.adopt(worker.task)
        if deleting and uid not in self._terminations:
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            self._terminations[uid] = self.tasks.start(
                self._terminate(pod, worker, grace), name=f"terminate-{meta['name']}"
            )

    async def _terminate(self, pod: Obj, worker: PodWorker | None, grace: float) -> None:
        meta = pod["metadata"]
        try:
            if worker is not None:
                logger.info(
                    "stopping pod %s/%s (grace %ss)", meta["namespace"], meta["name"], grace
                )
                await worker.terminate(grace)
            await self.node_up()
            if worker is None:
                self._fail_unstarted(meta["uid"])
            options = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
            with contextlib.suppress(errors.ApiError):
                self.store.delete(self._type("pods"), meta["namespace"], meta["name"], options)
        finally:
            self._terminations.pop(meta["uid"], None)

    def _fail_unstarted(self, uid: str) -> None:
        """A pod deleted before it started and held by a finalizer: terminal (Failed), not
        Pending forever (one without finalizers is simply gone, as the kubelet spares the
        write then)."""
        pod = self.store.by_uid(uid)
        if pod is None or not pod["metadata"].get("finalizers"):
            return
        status = podspec.deleted_before_start(pod.get("status") or {}, now_iso())
        if status is not None:
            self._write_status(pod, status)

    def _forget(self, worker: PodWorker) -> None:
        self.workers.pop(worker.uid, None)
        self._ips.give_back(worker.ip)
        task = self._terminations.pop(worker.uid, None)
        if task is not None:
            task.cancel()

    def report(self, worker: PodWorker) -> None:
        """Write a worker's pod status (a lost node reports nothing)."""
        if self.lost:
            return
        pod = self.store.by_uid(worker.uid)
        if pod is None:
            return
        self._write_status(pod, worker.status(pod.get("status") or {}))

    def _write_status(self, pod: Obj, status: Obj) -> None:
        """Write ``status`` through the pod's status subresource; an API error (the pod
        removed meanwhile) drops the write."""
        meta = pod["metadata"]
        with contextlib.suppress(errors.ApiError):
            self.store.update(
                self._type("pods"),
                meta["namespace"],
                meta["name"],
                {**pod, "status": status},
                subresource="status",
            )

    # ------------------------------------------------------------------ node
    def _write_node(self, ready: bool = True) -> None:
        nodes = self._type("nodes")
        now = now_iso()
        condition = (
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
            }
            if ready
            else {
                "type": "Ready",
                "status": "Unknown",
                "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status.",
            }
        )
        condition.update({"lastHeartbeatTime": now, "lastTransitionTime": now})
        taints = (
            []
            if ready
            else [
                {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule", "timeAdded": now},
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": now},
            ]
        )
        body: Obj = {
            "metadata": {
                "name": self.node_name,
                "labels": {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux"},
                "annotations": {
                    mountns.ISOLATION_ANNOTATION: self.isolation,
                    cpucontrol.CPU_CONTROL_ANNOTATION: self.cpu_note,
                },
            },
            "spec": {"taints": taints} if taints else {},
            "status": {
                "conditions": [condition],
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": self.node_name},
                ],
                "capacity": node_capacity(),
                "allocatable": node_capacity(),
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": "",
                    "containerRuntimeVersion": "local-processes://1",
                    "kernelVersion": os.uname().release,
                    "kubeProxyVersion": "",
                    "kubeletVersion": "v1.32.0-rolloutrun-localcluster",
                    "machineID": "",
                    "operatingSystem": "linux",
                    "osImage": "local",
                    "systemUUID": "",
                },
            },
        }
        current = self.store.find(nodes, "", self.node_name)
        if current is None:
            created = self.store.create(nodes, "", body)
            self.store.update(
                nodes,
                "",
                self.node_name,
                {**created, "status": body["status"]},
                subresource="status",
            )
        else:
            updated = self.store.update(
                nodes, "", self.node_name, {**current, "spec": body["spec"]}
            )
            self.store.update(
                nodes,
                "",
                self.node_name,
                {**updated, "status": body["status"]},
                subresource="status",
            )

    def lose_node(self, mode: str = "freeze") -> None:
        """The node stops answering: processes frozen (``freeze``), gone (``kill``) or still
        running behind cut links (``partition``, see :mod:`.partition`)."""
        if mode not in ("freeze", "kill", "partition"):
            raise ValueError(f"mode must be 'freeze', 'kill' or 'partition', not {mode!r}")
        self._write_node(ready=False)
        self._mark_pods_not_ready()
        self.lost = mode
        self._node_up.clear()
        for worker in self.workers.values():
            if mode == "freeze":
                worker.freeze(True)
            elif mode == "kill":
                worker.kill_processes_only()
        logger.info("node %s lost (%s)", self.node_name, mode)

    def _mark_pods_not_ready(self) -> None:
        pods = self._type("pods")
        for pod in self.store.objects("pods"):
            if (pod.get("spec") or {}).get("nodeName") != self.node_name:
                continue
            status = dict(pod.get("status") or {})
            conditions = []
            for condition in status.get("conditions") or []:
                if condition.get("type") == "Ready" and condition.get("status") == "True":
                    condition = {
                        **condition,
                        "status": "False",
                        "reason": "NodeNotReady",
                        "lastTransitionTime": now_iso(),
                    }
                conditions.append(condition)
            status["conditions"] = conditions
            status["containerStatuses"] = [
                {**c, "ready": False} for c in status.get("containerStatuses") or []
            ]
            meta = pod["metadata"]
            with contextlib.suppress(errors.ApiError):
                self.store.update(
                    pods,
                    meta["namespace"],
                    meta["name"],
                    {**pod, "status": status},
                    subresource="status",
                )

    def restore_node(self) -> None:
        """The node is back: frozen processes resume, the kubelet reports and acts again."""
        mode, self.lost = self.lost, None
        if mode == "freeze":
            for worker in self.workers.values():
                worker.freeze(False)
        self._write_node(ready=True)
        self._node_up.set()
        for worker in list(self.workers.values()):
            self.report(worker)
        self._dirty.update(p["metadata"]["uid"] for p in self.store.objects("pods"))
        self._dirty.update(self.workers)
        self._wake.set()
        logger.info("node %s restored", self.node_name)


def node_capacity() -> Obj:
    """The machine's CPUs and memory, as a real kubelet reports them (``kubectl describe
    node`` divides pod requests by these; without memory it printed a nonsense percentage)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": str(os.cpu_count() or 1), "memory": f"{memory // 1024}Ki", "pods": "250"}

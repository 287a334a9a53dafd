"""Pod networks: a network namespace per pod on a bridge, or today's shared loopback.

Why: with every pod on the machine's loopback, a pod listening on ``0.0.0.0`` answers at
every pod IP, two pods cannot use one port, a dead pod's address still answers, and no link
can be cut. In ``namespaces`` mode each pod gets its own network namespace
(``rr-<cluster>-<owner pid>-p<N>``) whose ``eth0`` (a veth) sits on a bridge inside a
cluster-owned "node" namespace (``rr-<cluster>-<owner pid>-node``); nothing is added to the
machine's root namespace. Pods reach each other by pod IP over the bridge. The root
namespace is reached only through per-pod forwarders (:mod:`.netforward`): each pod's own
``127.0.0.1:<port>`` relays to the machine's ``127.0.0.1:<port>`` for the API server and the
host services the cluster is told about, so ``KUBERNETES_SERVICE_HOST`` and
``STORAGE_EMULATOR_HOST`` mean the same thing in both modes. The kubelet reaches pods (HTTP
and TCP probes, :meth:`NamespaceNetwork.dial`) through sockets created inside the node
namespace: Python 3.11 has no ``os.setns``, so a short-lived thread calls libc ``setns``,
creates the socket, and the socket keeps its namespace.

A partition (:meth:`cut`) sets the pod's veth down in the node namespace and pauses its
forwarders: packets are dropped, connections hang as on a real cut link, and resume on
:meth:`heal`. In ``loopback`` mode the only honest equivalent is to freeze the pod's
processes (SIGSTOP), which is weaker: the pod stops computing too.

The mode comes from the ``network`` argument of ``LocalCluster`` or the environment
variable ``ROLLOUTRUN_LOCALCLUSTER_NETWORK`` (``namespaces``, ``loopback`` or ``auto``, the
default: namespaces when the machine permits them, else loopback with a warning).
Namespaces are removed when their pod ends and when the cluster stops; those of a crashed
earlier session (owner process gone) or of an earlier cluster on the same directory are
removed when a cluster starts.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hashlib
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from .netforward import Forwarder

logger = logging.getLogger(__name__)

ENV_NETWORK = "ROLLOUTRUN_LOCALCLUSTER_NETWORK"
MODES = ("namespaces", "loopback", "auto")
NETNS_DIR = "/run/netns"
PREFIX = "rr-"
CLONE_NEWNET = 0x40000000
BRIDGE = "br0"


class NetworkError(RuntimeError):
    """The pod network cannot be set up as asked."""


# ---------------------------------------------------------------------- decisions (pure)
def requested_mode(argument: str | None, environ: dict[str, str] | None = None) -> str:
    """The mode asked for: the argument, else the environment variable, else ``auto``."""
    env = os.environ if environ is None else environ
    mode = (argument or env.get(ENV_NETWORK) or "auto").strip().lower()
    if mode not in MODES:
        raise NetworkError(
            f"pod network mode {mode!r} is not one of {', '.join(MODES)} "
            f"(from the network argument or ${ENV_NETWORK})"
        )
    return mode


def namespaces_unavailable() -> str | None:
    """Why this machine cannot run namespace mode, or ``None`` when it can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def bridge_network(pod_network: str) -> ipaddress.IPv4Network:
    """The bridge's /16 for a cluster: ``10.X.0.0/16`` with X the loopback network's second
    octet, so the pod IPs of clusters side by side differ in logs too."""
    second = ipaddress.IPv4Network(pod_network).network_address.packed[1]
    return ipaddress.IPv4Network(f"10.{second}.0.0/16")


def cluster_id(directory: str) -> str:
    return hashlib.sha1(directory.encode()).hexdigest()[:8]


def stale(name: str, own_prefix: str, alive: Callable[[int], bool]) -> bool:
    """Whether namespace ``name`` is a leftover: ours from an earlier cluster on the same
    directory, or any cluster's whose owner process is gone."""
    if not name.startswith(PREFIX):
        return False
    if name.startswith(own_prefix):
        return True
    parts = name.split("-")
    return len(parts) >= 4 and parts[2].isdigit() and not alive(int(parts[2]))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def host_ports_in(env: dict[str, str]) -> set[int]:
    """Ports of loopback URLs in the pods' extra environment (``STORAGE_EMULATOR_HOST``...):
    host services the pods are told about, so they are forwarded into each pod."""
    ports: set[int] = set()
    for value in env.values():
        for host in ("127.0.0.1:", "localhost:"):
            start = value.find(host)
            if start < 0:
                continue
            digits = ""
            for char in value[start + len(host) :]:
                if not char.isdigit():
                    break
                digits += char
            if digits:
                ports.add(int(digits))
    return ports


# ---------------------------------------------------------------------- namespaces (I/O)
def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def remove_stale(own_prefix: str) -> list[str]:
    removed = [n for n in list_namespaces() if stale(n, own_prefix, _pid_alive)]
    for name in removed:
        _ip("netns", "del", name, check=False)
    if removed:
        logger.warning("removed %d network namespaces left by earlier clusters", len(removed))
    return removed


_libc = ctypes.CDLL(None, use_errno=True)


def socket_in(namespace: str, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket created inside network namespace ``namespace`` (it stays there)."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def create() -> None:
        try:
            with open(os.path.join(NETNS_DIR, namespace)) as handle:
                if _libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {namespace}")
            made.append(socket.socket(family, socket.SOCK_STREAM))
        except BaseException as error:
            failed.append(error)

    thread = threading.Thread(target=create, name=f"setns-{namespace}")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


# ---------------------------------------------------------------------- the two modes
class Attached(Protocol):
    """What the network needs of a pod worker."""

    uid: str
    ip: str


class PodNetwork(Protocol):
    mode: str
    description: str

    def pool_network(self) -> str: ...
    def argv_prefix(self, uid: str) -> list[str]: ...
    async def attach(self, pod: Attached) -> None: ...
    async def detach(self, pod: Attached) -> None: ...
    def dialer(self) -> Callable[[], socket.socket] | None: ...
    async def cut(self, uids: Iterable[str]) -> None: ...
    async def heal(self, uids: Iterable[str]) -> None: ...
    async def close(self) -> None: ...


class LoopbackNetwork:
    """Today's mode: every pod on the machine's loopback with its own ``127.X.N.M``."""

    mode = "loopback"

    def __init__(self, pod_network: str) -> None:
        self._pod_network = pod_network
        self.description = f"loopback ({pod_network}, shared root network namespace)"

    def pool_network(self) -> str:
        return self._pod_network

    def argv_prefix(self, uid: str) -> list[str]:
        return []

    async def attach(self, pod: Attached) -> None:
        return None

    async def detach(self, pod: Attached) -> None:
        return None

    def dialer(self) -> Callable[[], socket.socket] | None:
        return None  # the pods are on the machine's loopback: plain sockets reach them

    async def cut(self, uids: Iterable[str]) -> None:
        return None  # the cluster freezes the pods instead (see LocalCluster.partition)

    async def heal(self, uids: Iterable[str]) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass
class _Pod:
    namespace: str
    veth: str
    forwarder: Forwarder
    cut: bool = False


@dataclass
class NamespaceNetwork:
    """A node namespace with a bridge, and a namespace plus veth per pod."""

    directory: str
    pod_network: str
    host_ports: Callable[[], set[int]]
    mode: str = "namespaces"
    pods: dict[str, _Pod] = field(default_factory=dict)
    _counter: int = 0

    def __post_init__(self) -> None:
        self.prefix = f"{PREFIX}{cluster_id(self.directory)}-"
        self.owner = f"{self.prefix}{os.getpid()}-"
        self.node = f"{self.owner}node"
        self.subnet = bridge_network(self.pod_network)
        self.gateway = str(self.subnet.network_address + 1)
        self.description = f"namespaces (bridge {self.subnet} in network namespace {self.node})"

    def pool_network(self) -> str:
        return str(self.subnet)

    def start(self) -> None:
        remove_stale(self.prefix)
        _ip("netns", "add", self.node)
        try:
            _ip("-n", self.node, "link", "set", "lo", "up")
            _ip("-n", self.node, "link", "add", BRIDGE, "type", "bridge")
            _ip(
                "-n",
                self.node,
                "addr",
                "add",
                f"{self.gateway}/{self.subnet.prefixlen}",
                "dev",
                BRIDGE,
            )
            _ip("-n", self.node, "link", "set", BRIDGE, "up")
        except NetworkError:
            _ip("netns", "del", self.node, check=False)
            raise

    def namespace_of(self, uid: str) -> str:
        return self.pods[uid].namespace

    def argv_prefix(self, uid: str) -> list[str]:
        """Run a container's process inside the pod's network namespace."""
        return ["nsenter", f"--net={NETNS_DIR}/{self.namespace_of(uid)}", "--"]

    def dialer(self) -> Callable[[], socket.socket] | None:
        """Makes sockets that reach pod IPs (created in the node namespace)."""
        return functools.partial(socket_in, self.node)

    async def attach(self, pod: Attached) -> None:
        self._counter += 1
        name, veth = f"{self.owner}p{self._counter}", f"veth{self._counter}"
        plen = self.subnet.prefixlen
        await asyncio.to_thread(self._create, name, veth, pod.ip, plen)
        forwarder = Forwarder(lambda: socket_in(name), sorted(self.host_ports()))
        self.pods[pod.uid] = _Pod(name, veth, forwarder)
        await forwarder.start()

    def _create(self, name: str, veth: str, ip: str, plen: int) -> None:
        _ip("netns", "add", name)
        try:
            _ip(
                "-n",
                self.node,
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                name,
            )
            _ip("-n", self.node, "link", "set", veth, "master", BRIDGE, "up")
            _ip("-n", name, "addr", "add", f"{ip}/{plen}", "dev", "eth0")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "route", "add", "default", "via", self.gateway)
        except NetworkError:
            _ip("netns", "del", name, check=False)
            raise

    async def detach(self, pod: Attached) -> None:
        """Remove the pod's namespace (its processes are dead): its address is gone, the
        veth with it, and every connection through its forwarders is closed."""
        entry = self.pods.pop(pod.uid, None)
        if entry is None:
            return
        await entry.forwarder.close()
        await asyncio.to_thread(_ip, "netns", "del", entry.namespace, check=False)

    async def cut(self, uids: Iterable[str]) -> None:
        for uid in uids:
            entry = self.pods.get(uid)
            if entry is None or entry.cut:
                continue
            entry.cut = True
            entry.forwarder.pause()
            await asyncio.to_thread(_ip, "-n", self.node, "link", "set", entry.veth, "down")

    async def heal(self, uids: Iterable[str]) -> None:
        for uid in uids:
            entry = self.pods.get(uid)
            if entry is None or not entry.cut:
                continue
            entry.cut = False
            await asyncio.to_thread(_ip, "-n", self.node, "link", "set", entry.veth, "up")
            entry.forwarder.resume()

    async def close(self) -> None:
        for uid in list(self.pods):
            entry = self.pods.pop(uid)
            await entry.forwarder.close()
            await asyncio.to_thread(_ip, "netns", "del", entry.namespace, check=False)
        await asyncio.to_thread(_ip, "netns", "del", self.node, check=False)


def create(
    argument: str | None,
    directory: str,
    pod_network: str,
    host_ports: Callable[[], set[int]],
) -> PodNetwork:
    """The cluster's pod network in the mode asked for (``auto``: namespaces if permitted)."""
    mode = requested_mode(argument)
    if mode == "loopback":
        return LoopbackNetwork(pod_network)
    why = namespaces_unavailable()
    if why is None:
        network = NamespaceNetwork(directory, pod_network, host_ports)
        try:
            network.start()
            return network
        except NetworkError as error:
            why = str(error)
    if mode == "namespaces":
        raise NetworkError(f"pod network mode 'namespaces' is not possible here: {why}")
    logger.warning("pod network: namespaces not possible (%s); using loopback", why)
    return LoopbackNetwork(pod_network)

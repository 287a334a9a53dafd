"""``LocalCluster``: the API server emulator, its controllers and the process kubelet.

One object, one directory, one asyncio loop. Use it from async code (``await
cluster.astart()`` / ``astop()`` or ``async with``) or from sync code (``start()`` /
``stop()`` or ``with``), where it runs its loop in a background thread. Stopping it kills
every pod process. The directory holds ``kubeconfig`` and ``pods/<ns>/<name>-<uid>/``
(logs, working directory, volumes, the pod's kubeconfig and service-account token).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web

from rolloutrun_operator.gc_pacing import pace_gc

from . import access, images, kubeconfig, mountns, netns, partition, podgc, podspec, tls
from .controllers import Controllers
from .kubelet import IpPool, Kubelet
from .logs import PodLogs
from .podworker import PodWorker
from .processes import cluster_tag, kill_tagged, pod_tag, tagged_pids
from .resources import Registry
from .scheduler import Scheduler
from .server import ApiServer
from .storage_provisioner import Provisioner
from .store import Store
from .tasks import cancel_remaining

logger = logging.getLogger(__name__)

T = TypeVar("T")
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class LocalCluster:
    """A one-node Kubernetes cluster whose pods are local processes."""

    def __init__(
        self,
        directory: Path | str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        extra_env: dict[str, str] | None = None,
        bookmark_interval: float = 5.0,
        history: int = 50_000,
        restart_backoff: tuple[float, float] = podspec.RESTART_BACKOFF,
        image_backoff: tuple[float, float] = images.IMAGE_BACKOFF,
        unpullable_images: Iterable[str] = (),
        nodes: int = 1,
        pod_network: str = "127.0.0.0/16",
        isolation: str | None = None,
        network: str | None = None,
        pace_gc: bool = False,
        pod_gc: tuple[float, float] = podgc.POD_GC,
    ) -> None:
        self.directory = Path(directory).resolve()
        self.host = host
        self.port = port
        self.token = token or secrets.token_urlsafe(24)
        self.registry = Registry()
        self.store = Store(self.registry, history=history)
        self._extra_env = extra_env
        self._bookmark_interval = bookmark_interval
        self._backoff = restart_backoff
        self._image_backoff = image_backoff
        self._pod_gc = pod_gc
        # Which images cannot be pulled (images.py); tests refuse and allow while it runs.
        self.images = images.Images.from_env(unpullable_images)
        self.pod_network = pod_network
        # Each pod its own mount namespace, or the loopback fallback (see .mountns).
        self.isolation = mountns.choose_mode(isolation)
        # namespaces | loopback | auto (None: $ROLLOUTRUN_LOCALCLUSTER_NETWORK); see netns.py
        self.network_mode = netns.requested_mode(network)
        self.network: netns.PodNetwork | None = None
        self.node_names = ["local", *(f"local-{index}" for index in range(2, nodes + 1))]
        self.controllers: Controllers | None = None
        self.scheduler: Scheduler | None = None
        self.provisioner: Provisioner | None = None
        self.kubelets: dict[str, Kubelet] = {}
        self.server: ApiServer | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        # A cluster that is its own process paces its collector (gc_pacing: no full pass
        # over every stored object inside a request); one inside a library user's never.
        self._pace_gc = pace_gc
        self._gc_pacer: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ facts
    @property
    def api_url(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def ca_path(self) -> Path:
        """The cluster CA certificate (PEM) that signs the API server's certificate."""
        return self.directory / "pki" / "ca.crt"

    @property
    def kubeconfig_path(self) -> Path:
        return self.directory / "kubeconfig"

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def kubelet(self) -> Kubelet:
        """The kubelet of the first node, ``local``."""
        return self.kubelets[self.node_names[0]]

    def _account_token(self, account: dict[str, Any]) -> str:
        """The token the kubelet mounts for a pod of ``account`` (valid while it exists)."""
        assert self.server is not None
        return self.server.access.authenticator.issue(account)[0]

    # ------------------------------------------------------------------ async API
    async def astart(self) -> LocalCluster:
        """Start serving on this loop; return once the API answers and the node is Ready."""
        self._loop = asyncio.get_running_loop()
        self.directory.mkdir(parents=True, exist_ok=True)
        leftovers = kill_tagged(cluster_tag(str(self.directory)), [])
        if leftovers:
            logger.warning("killed %d pod processes left by an earlier run", leftovers)
        certificates = tls.ensure(self.directory)
        ca_pem = certificates.ca.read_bytes()
        self.controllers = Controllers(self.store, self.registry, ca_pem, pod_gc=self._pod_gc)
        self.scheduler = Scheduler(self.store, self.registry)
        self.provisioner = Provisioner(self.store, self.registry, self.directory)
        self.network = await asyncio.to_thread(
            netns.create,
            self.network_mode,
            str(self.directory),
            self.pod_network,
            lambda: {self.port, *netns.host_ports_in(self._extra_env or {})},
        )
        ips = IpPool(self.network.pool_network(), loopback=self.network.mode == "loopback")
        for node in self.node_names:
            self.kubelets[node] = Kubelet(
                self.store,
                self.registry,
                self.directory,
                token=self.token,
                account_token=self._account_token,
                kubeconfig_for=lambda ns, token: kubeconfig.render(self.api_url, token, ca_pem, ns),
                ca_pem=ca_pem,
                api_port=lambda: self.port,
                node_name=node,
                ips=ips,
                extra_env=self._extra_env,
                backoff=self._backoff,
                image_backoff=self._image_backoff,
                registry_images=self.images,
                isolation=self.isolation,
                network=self.network,
            )
        logs = PodLogs(lambda: self.kubelets.values())
        self.server = ApiServer(self.store, self.registry, self.token, logs=logs)
        self.server.watches.bookmark_interval = self._bookmark_interval
        namespaces = self.registry.get("", "v1", "namespaces")
        assert namespaces is not None
        for name in SYSTEM_NAMESPACES:
            if self.store.find(namespaces, "", name) is None:
                self.store.create(namespaces, "", {"metadata": {"name": name}})
        access.bootstrap(self.store, self.registry)
        self._runner = web.AppRunner(
            self.server.app, handle_signals=False, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.host,
            self.port,
            reuse_address=True,
            ssl_context=certificates.server_context(),
        )
        await site.start()
        sockets = self._runner.addresses
        self.port = int(sockets[0][1])
        self.server.address = f"{self.host}:{self.port}"
        kubeconfig.write(self.kubeconfig_path, self.api_url, self.token, ca_pem)
        self.controllers.start()
        self.provisioner.start()
        for kubelet in self.kubelets.values():
            kubelet.start()
        self.scheduler.start()
        if self._pace_gc:
            self._gc_pacer = asyncio.create_task(pace_gc(), name="gc-pacing")
        logger.info(
            "local cluster serving at %s (kubeconfig %s), pods isolated by %s, pod network: %s",
            self.api_url,
            self.kubeconfig_path,
            self.isolation,
            self.network.description,
        )
        return self

    async def astop(self) -> None:
        """Stop: end watches, kill every pod process, stop the controllers and the server."""
        if self._runner is None:
            return
        assert self.server is not None and self.controllers is not None
        assert self.scheduler is not None
        self.server.watches.drop_all()
        if self._gc_pacer is not None:
            self._gc_pacer.cancel()
            await asyncio.gather(self._gc_pacer, return_exceptions=True)
            self._gc_pacer = None
        await self.scheduler.stop()
        for kubelet in self.kubelets.values():
            await kubelet.stop()
        await self.controllers.stop()
        if self.provisioner is not None:
            await self.provisioner.stop()
        if self.network is not None:
            await self.network.close()
        self.server.watches.drop_all()
        await self._runner.cleanup()
        self._runner = None
        logger.info("local cluster at %s stopped", self.api_url)

    async def __aenter__(self) -> LocalCluster:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    # ------------------------------------------------------------------ sync API
    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start in a background thread with its own loop (for sync code and tests)."""
        started: concurrent.futures.Future[None] = concurrent.futures.Future()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._stopping = asyncio.Event()
            try:
                loop.run_until_complete(self.astart())
            except BaseException as error:
                started.set_exception(error)
                loop.close()
                return
            started.set_result(None)
            try:
                loop.run_until_complete(self._stopping.wait())
                loop.run_until_complete(self.astop())
            finally:
                # Nothing may be left pending when the loop closes (see tasks.py).
                loop.run_until_complete(cancel_remaining())
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name="localcluster", daemon=True)
        self._thread.start()
        started.result(timeout)
        atexit.register(self.stop)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the background cluster (idempotent); every pod process is killed."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        self._thread = None
        atexit.unregister(self.stop)
        if thread.is_alive():
            loop.call_soon_threadsafe(stopping.set)
            thread.join(timeout)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the cluster's loop (directly when already on it)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the local cluster is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return fn(*args)

        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(30)

    # ------------------------------------------------------------------ test levers
    def lose_node(self, mode: str = "freeze", node: str = "local") -> None:
        """Play a node loss: the node turns NotReady, its pods unready and unreported, their
        processes frozen (``freeze``, SIGSTOP) or killed (``kill``, as a crashed machine)."""
        self.call(self.kubelets[node].lose_node, mode)

    def restore_node(self, node: str = "local") -> None:
        """The lost node comes back: processes resume (or report their deaths)."""
        self.call(self.kubelets[node].restore_node)

    def partition(
        self,
        *,
        pod: str | None = None,
        node: str | None = None,
        seconds: float,
        namespace: str = "default",
    ) -> partition.Partition:
        """Cut a pod's (or every pod of a node's) links for ``seconds``, then heal them; returns
        once cut. Namespace mode cuts links; loopback mode can only freeze (see partition.py)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the local cluster is not running")
        job = partition.start(
            self.kubelets, namespace=namespace, pod=pod, node=node, seconds=seconds
        )
        return asyncio.run_coroutine_threadsafe(job, loop).result(30)

    def node_of(self, namespace: str, name: str) -> str | None:
        """The node a pod is bound to (``None`` while unscheduled or gone)."""
        pods = self.registry.get("", "v1", "pods")
        assert pods is not None
        pod = self.call(self.store.find, pods, namespace, name)
        return None if pod is None else (pod.get("spec") or {}).get("nodeName")

    def drop_watches(self) -> int:
        """End every open watch stream, as an API server restart does; clients must re-watch."""
        assert self.server is not None
        return self.call(self.server.watches.drop_all)

    def compact(self) -> None:
        """Forget the watch history (etcd compaction): older resourceVersions get 410 Gone."""
        self.call(self.store.compact)

    def _worker(self, namespace: str, name: str) -> PodWorker | None:
        for kubelet in self.kubelets.values():
            for worker in kubelet.workers.values():
                if (worker.namespace, worker.name) == (namespace, name):
                    return worker
        return None

    def pod_dir(self, namespace: str, name: str) -> Path | None:
        """The directory of a running pod (logs, work dir, volumes), if it has a worker."""
        worker = self.call(self._worker, namespace, name)
        return None if worker is None else worker.dir

    def pod_pids(self, namespace: str, name: str) -> set[int]:
        """Every live process the named pod started (its containers and their children)."""

        def find() -> set[int]:
            worker = self._worker(namespace, name)
            if worker is None:
                return set()
            return tagged_pids(pod_tag(worker.uid), worker.sessions)

        return self.call(find)

"""The trainer's place in a Ray cluster: a head on its pod address, a node joining one, or
a private Ray on 127.0.0.1; and where the generation actors go.

Why: a Ray driver needs a Ray node on its own machine, so a trainer pod that only calls
``ray.init("host:port")`` cannot join a cluster (only Ray Client, ``ray://``, worked). Here
the trainer itself becomes a node: with worker pods (``workers.workerNodes``) it starts the
head, bound to ``$POD_IP`` with the GCS on :data:`~rolloutrun_runtime.contract.pod.RAY_GCS_PORT`,
and the worker pods join it (:mod:`.ray_node`); given a GCS address (an existing KubeRay
cluster) it joins as a node offering nothing, and drives from there. The node runs as
``ray start --block`` in its own process group, so stopping it is one signal to the group
and a crashed trainer takes it down with its pod.

The generation actors ask for one unit of
:data:`~rolloutrun_runtime.contract.pod.RAY_GENERATION_RESOURCE` when worker nodes are
configured (only worker nodes offer it: the actors never land on the trainer's node), and
run beside the trainer otherwise (today's in-pod behaviour).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.contract.pod import RAY_GCS_PORT, RAY_GENERATION_RESOURCE, ray_auth_token

if TYPE_CHECKING:  # annotations only: a worker pod's entry point imports this module
    from rolloutrun_runtime.contract.run_config import RunConfig

logger = logging.getLogger(__name__)

#: Seconds to wait for a Ray node's GCS to answer (a loaded machine starts Ray slowly).
NODE_START_TIMEOUT_S = 120.0
#: Seconds a stopped node gets to end before its group is killed (``ray start --block``
#: drains on SIGTERM, which waits on nodes that may be gone: the run's state is durable
#: elsewhere, so the wait is short).
NODE_STOP_TIMEOUT_S = 5.0
#: Ray refuses multi-node clusters when this is 0 (its name says Windows and macOS, but it
#: is read on Linux too): a node we start sets it so that worker nodes may join.
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: How soon the head's GCS declares a silent node dead (Ray's defaults: a check every 3 s,
#: dead after 5 misses, ~15 s): until then a refit's call on the lost worker pod's actor
#: waits, and the train pump with it. Ours: every 1 s, dead after 3 misses of 2 s each;
#: the environment may say otherwise.
HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
#: Starts of a private Ray (its raylet missed Ray's own start-up bound) before giving up.
PRIVATE_START_ATTEMPTS = 3
#: Ray's own bound on a node's start: ``ray start`` exits when its raylet has not registered
#: with the GCS within 30 s (``ray/_private/node.py``), after the GCS port has opened.
RAY_START_BOUND_S = 30.0
#: A node of ours alive this long after its GCS port opened has started, whatever it printed.
STARTED_AFTER_S = RAY_START_BOUND_S + 5.0
#: What ``ray start`` prints once its node is up (the head's or a joining node's).
STARTED_LINE = b"Ray runtime started."
#: Starts of the trainer's own node (the head, or a node joining a cluster) that ended before
#: the driver was connected, before the trainer gives up with :class:`RayNodeEndedError`.
NODE_START_ATTEMPTS = 3
#: Ray's connection tries in ``ray.init`` (about 40 s each when the GCS is gone; 20 by
#: default, so a dead head held the trainer a quarter of an hour): one, then our loop,
#: which looks at the node between tries, decides.
RAY_GCS_TRIES_ENV = "RAY_gcs_server_port_wait_time_s"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"


class AddressKind(enum.StrEnum):
    CLIENT = "client"  # ray://host:port, Ray Client: no node needed here
    GCS = "gcs"  # host:port, the GCS: this process joins as a node


class RayClusterError(RuntimeError):
    """A Ray node could not be started or joined."""


class RayNodeEndedError(RayClusterError):
    """The trainer's own Ray node (``ray start``) ended before the driver was connected:
    Ray's start bound missed on a loaded machine, or the node crashed. Started again up to
    :data:`NODE_START_ATTEMPTS` times, then the trainer ends with it (the run restarts)."""


@dataclass(frozen=True)
class RayAddress:
    kind: AddressKind
    host: str
    port: int

    @property
    def gcs(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(address: str) -> RayAddress:
    """``ray://host:port`` or ``host:port``; anything else is refused by name."""
    kind = AddressKind.GCS
    rest = address.strip()
    if rest.startswith("ray://"):
        kind, rest = AddressKind.CLIENT, rest[len("ray://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in rest or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayClusterError(
            f"workers.rayAddress {address!r} is neither a GCS address 'host:port' nor "
            "'ray://host:port'"
        )
    return RayAddress(kind, host, int(port))


def ray_command(*args: str) -> list[str]:
    """The ``ray`` CLI of this interpreter (no reliance on ``$PATH``)."""
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def head_argv(node_ip: str, port: int = RAY_GCS_PORT) -> list[str]:
    """``ray start --head`` on ``node_ip`` with the GCS on ``port``, offering no generation
    slots (the head is the trainer's node). No CPUs: no task or actor of ours runs on the
    trainer's node (the generation actors ask for the worker nodes' generation slot), and a
    head with CPUs prestarts one idle Ray worker per CPU (each an ``import ray`` at the
    trainer's start, then ~0.1 CPU-s per 15 s of polling, on the trainer's cores: measured
    with ``bench.pod_cpu``). No log monitor: the driver takes no worker logs
    (``log_to_driver=False``), as on the worker nodes."""
    return ray_command(
        "start",
        "--head",
        f"--node-ip-address={node_ip}",
        f"--port={port}",
        "--num-cpus=0",
        "--include-dashboard=false",
        "--include-log-monitor=false",
        "--disable-usage-stats",
        "--block",
    )


def member_argv(gcs: str, node_ip: str) -> list[str]:
    """``ray start`` joining ``gcs`` as ``node_ip``: a driver's node, offering nothing."""
    return ray_command(
        "start",
        f"--address={gcs}",
        f"--node-ip-address={node_ip}",
        "--num-cpus=0",
        "--disable-usage-stats",
        "--block",
    )


def auth_env(auth_token: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """Ray's token authentication with the run's Ray token (:func:`ray_auth_token`), unless
    the environment chose a mode already (tests run ``RAY_AUTH_MODE=disabled``)."""
    if auth_token is None or environ.get(RAY_AUTH_MODE_ENV):
        return {}
    return {RAY_AUTH_MODE_ENV: "token", RAY_AUTH_TOKEN_ENV: auth_token}


def node_env(
    environ: dict[str, str] | None = None, auth_token: str | None = None
) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    env[RAY_CLUSTER_ENV] = "1"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in HEALTH_CHECK_ENV.items():
        env.setdefault(name, value)
    env.update(auth_env(auth_token, env))
    return env


def registered_node_ip(host: str) -> str:
    """The address a node of ours started with ``--node-ip-address=host`` registers under.

    Why: with clusters enabled (:func:`node_env` sets :data:`RAY_CLUSTER_ENV`), ``ray start``
    replaces a loopback address by this machine's outward one (Ray's
    ``resolve_ip_for_localhost``), and the driver's ``ray.init`` must ask for that same
    node. A driver whose process has clusters disabled (tests set it, as Ray asks) would
    keep the loopback address and never find its node: on a machine with a default route the
    trainer's head on 127.0.0.1 registered as the machine's address, and ``ray.init`` failed
    until its start bound. Checked against Ray 2.60 (``ray._private.services``)."""
    from ray._private import services

    if not services.is_localhost(host):
        return host
    return str(services.node_ip_address_from_perspective())


def wait_for_port(host: str, port: int, timeout_s: float, alive: Any = None) -> None:
    """Until ``host:port`` accepts a connection (``alive()`` false: the process died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as error:
            if alive is not None and not alive():
                raise RayClusterError(f"the Ray node ended before {host}:{port}") from error
            if time.monotonic() > deadline:
                raise RayClusterError(f"no Ray GCS at {host}:{port}: {error}") from error
            time.sleep(0.2)


class Readiness(enum.StrEnum):
    READY = "ready"
    ENDED = "ended"
    WAIT = "wait"


def readiness(said_started: bool, alive: bool, since_open_s: float) -> Readiness:
    """Whether our node, its GCS port open ``since_open_s`` ago, has started: it said so, or
    outlived Ray's start bound (:data:`STARTED_AFTER_S`); or it ended. An open port alone is
    not a started node: ``ray start`` exits when its raylet misses Ray's 30 s bound, and a
    ``ray.init`` on the dead node retried its connection for a quarter of an hour."""
    if said_started:
        return Readiness.READY
    if not alive:
        return Readiness.ENDED
    return Readiness.READY if since_open_s >= STARTED_AFTER_S else Readiness.WAIT


class RayNode:
    """One ``ray start --block`` process group of ours (head or joining node)."""

    def __init__(
        self, argv: list[str], log_path: str | None = None, auth_token: str | None = None
    ) -> None:
        self.argv = argv
        self.log_path = log_path
        self.auth_token = auth_token
        self.process: subprocess.Popen[bytes] | None = None
        #: Where this start's output begins in the log (it is appended to), and the log
        #: when none was given (a private file, removed at stop): its start line is read.
        self._offset = 0
        self._own_log: str | None = None

    def start(self) -> None:
        path = self.log_path
        if path is None:
            descriptor, path = tempfile.mkstemp(prefix="ray-node-", suffix=".log")
            os.close(descriptor)
            self._own_log = path
        with open(path, "ab") as log:
            self._offset = log.tell()
            self.process = subprocess.Popen(
                self.argv,
                env=node_env(auth_token=self.auth_token),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopped (and killed) as one
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output(self) -> bytes:
        """What this start of the node has printed so far."""
        path = self.log_path or self._own_log
        if path is None:
            return b""
        try:
            with open(path, "rb") as log:
                log.seek(self._offset)
                return log.read()
        except OSError:
            return b""

    def said_started(self) -> bool:
        return STARTED_LINE in self.output()

    def ended_why(self) -> str:
        """The node's exit status and the last lines it printed, for an error message."""
        code = None if self.process is None else self.process.poll()
        lines = self.output().decode(errors="replace").strip().splitlines()[-3:]
        return f"exit status {code}" + (f": {' | '.join(lines)}" if lines else "")

    def stop(self) -> None:
        process, self.process = self.process, None
        if self._own_log is not None:
            with contextlib.suppress(OSError):
                os.remove(self._own_log)
            self._own_log = None
        if process is None:
            return
        for sig, wait in ((signal.SIGTERM, NODE_STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue


def wait_until_started(node: RayNode, host: str, port: int, timeout_s: float) -> None:
    """Until ``node`` (ours, serving or joining the GCS at ``host:port``) has started (see
    :func:`readiness`); :class:`RayNodeEndedError` when it ended first."""
    try:
        wait_for_port(host, port, timeout_s, node.alive)
    except RayClusterError as error:
        if not node.alive():
            raise RayNodeEndedError(f"{error} ({node.ended_why()})") from error
        raise
    opened = time.monotonic()
    while True:
        state = readiness(node.said_started(), node.alive(), time.monotonic() - opened)
        if state is Readiness.READY:
            return
        if state is Readiness.ENDED:
            raise RayNodeEndedError(
                f"the Ray node ended after {host}:{port} opened ({node.ended_why()})"
            )
        time.sleep(0.2)


def wants_worker_nodes(cfg: RunConfig) -> bool:
    return cfg.workers.worker_nodes > 0


def actor_resources(cfg: RunConfig) -> dict[str, float]:
    """The custom resources each generation actor asks for: one generation slot when the
    run has worker nodes, none (the trainer's node) otherwise."""
    return {RAY_GENERATION_RESOURCE: 1.0} if wants_worker_nodes(cfg) else {}


class RayConnection:
    """This process as a Ray driver, as ``cfg.workers`` says; :meth:`close` undoes what
    :meth:`open` did (a Ray initialised by the caller is reused and left running)."""

    def __init__(
        self,
        cfg: RunConfig,
        host: str,
        log_dir: str | None = None,
        token: str | None = None,
        *,
        head_port: int = RAY_GCS_PORT,
        node_prefix: tuple[str, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.host = host
        self.log_dir = log_dir
        #: The head's GCS port (the pod's fixed one; a test's free port).
        self.head_port = head_port
        #: Put before our node's ``ray start`` argv (a test's wrapper that ends the node).
        self.node_prefix = node_prefix
        #: The cluster's token (derived from the run's): our node and our driver use it.
        self.auth_token = ray_auth_token(token) if token else None
        self.node: RayNode | None = None
        self.owns_driver = False
        self.kind = "local"
        #: Set by :meth:`abandon` (another thread): :meth:`open` gives up at its next try.
        self._abandoned = threading.Event()

    def abandon(self) -> None:
        """Make an :meth:`open` running in another thread give up before its next try (of
        a node start or a driver connection): a stop during the start (the pod's SIGTERM
        ended our node too) must not wait while it starts the node again."""
        self._abandoned.set()

    def _check_abandoned(self) -> None:
        if self._abandoned.is_set():
            raise RayClusterError(f"the Ray {self.kind} node's start was abandoned (a stop)")

    def open(self) -> None:
        import ray

        if ray.is_initialized():
            self.kind = "existing"
            return
        address = self.cfg.workers.ray_address
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            parsed = parse_address(address)
            if parsed.kind is AddressKind.CLIENT:
                self.kind = "client"
                ray.init(address=address, log_to_driver=False)
                self.owns_driver = True
                return
            self.kind = "joined"
            argv, gcs_host, gcs_port = member_argv(parsed.gcs, self.host), parsed.host, parsed.port
        elif wants_worker_nodes(self.cfg):
            self.kind = "head"
            argv, gcs_host, gcs_port = (
                head_argv(self.host, self.head_port),
                self.host,
                self.head_port,
            )
        else:
            init_private(options)
            self.owns_driver = True
            return
        self._authenticate_driver()
        gcs = f"{gcs_host}:{gcs_port}"
        try:
            self._connect(argv, gcs_host, gcs_port)
        except BaseException:
            self.close()
            raise
        self.owns_driver = True
        logger.info("Ray driver on node %s (%s) of the cluster at %s", self.host, self.kind, gcs)

    def _authenticate_driver(self) -> None:
        """This process as a client of the token-authenticated cluster. Ray reads its auth
        mode into its config once (at import), so the config and the token cache are
        reloaded after the environment is set (as Ray's own tests do)."""
        env = auth_env(self.auth_token, os.environ)
        if not env:
            return
        os.environ.update(env)
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    def _connect(self, argv: list[str], gcs_host: str, gcs_port: int) -> None:
        """Our node started (:func:`wait_until_started`), then the driver on it; a node that
        ends first is started again, :data:`NODE_START_ATTEMPTS` starts in all."""
        for attempt in range(1, NODE_START_ATTEMPTS + 1):
            self._check_abandoned()
            try:
                self._start_node(argv, gcs_host, gcs_port)
                self._init_driver(f"{gcs_host}:{gcs_port}")
                return
            except RayNodeEndedError as error:
                self._drop_node()
                if attempt == NODE_START_ATTEMPTS:
                    raise RayNodeEndedError(
                        f"the trainer's Ray {self.kind} node on {self.host} ended before "
                        f"the driver connected, {attempt} starts in a row; the last: {error}"
                    ) from error
                logger.warning("Ray %s node ended (%s): starting it again", self.kind, error)

    def _init_driver(self, gcs: str) -> None:
        """``ray.init`` on our node: the GCS answers before our raylet has registered, so
        a refusal is retried while the node lives (bounded). Ray's own tries are cut to one
        (:data:`RAY_GCS_TRIES_ENV`): on a dead GCS each takes ~40 s, and 20 of them held the
        trainer past any bound; the node is looked at before each try."""
        import ray

        node_ip = registered_node_ip(self.host)  # one answer for every try
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while True:
            self._check_abandoned()
            if self.node is None or not self.node.alive():
                why = "never started" if self.node is None else self.node.ended_why()
                raise RayNodeEndedError(f"the Ray node at {self.host} ended ({why})")
            try:
                with _environ(RAY_GCS_TRIES_ENV, "1"):
                    ray.init(address=gcs, _node_ip_address=node_ip, log_to_driver=False)
                return
            except (ConnectionError, RuntimeError, ValueError) as error:
                ray.shutdown()
                if not self.node.alive():
                    raise RayNodeEndedError(
                        f"the Ray node at {self.host} ended: {error} ({self.node.ended_why()})"
                    ) from error
                if time.monotonic() > deadline:
                    raise RayClusterError(f"no Ray node at {self.host}: {error}") from error
                time.sleep(0.5)

    def _start_node(self, argv: list[str], gcs_host: str, gcs_port: int) -> None:
        log_dir = self.log_dir
        log = os.path.join(log_dir, "ray-node.log") if log_dir and os.path.isdir(log_dir) else None
        self.node = RayNode([*self.node_prefix, *argv], log, self.auth_token)
        self.node.start()
        wait_until_started(self.node, gcs_host, gcs_port, NODE_START_TIMEOUT_S)

    def _drop_node(self) -> None:
        """Stop our node's whole group (a GCS or raylet it left) before a new start."""
        if self.node is not None:
            self.node.stop()
            self.node = None
        if self.kind == "head":
            forget_head(f"{self.host}:{self.head_port}")

    def close(self) -> None:
        import ray

        if self.owns_driver:
            ray.shutdown()
            self.owns_driver = False
        if self.node is not None:
            self._drop_node()


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``name=value`` in this process's environment for the block only (a node started
    later must not inherit it: for ``ray start`` it bounds the GCS's own start)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def init_private(options: dict[str, Any]) -> None:
    """``ray.init`` of a private Ray on 127.0.0.1, tried :data:`PRIVATE_START_ATTEMPTS`
    times: Ray gives its raylet a fixed 30 s to register, which a loaded machine misses
    ("The current node timed out during startup"), and a second start usually makes it.

    ``address="local"``: without an address Ray joins the cluster named in its "current
    cluster" file, which a SIGKILLed head leaves behind; a private Ray never joins anything."""
    import ray

    for attempt in range(1, PRIVATE_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", _node_ip_address="127.0.0.1", **options)
            return
        except Exception as error:
            ray.shutdown()
            if attempt == PRIVATE_START_ATTEMPTS or "timed out during startup" not in str(error):
                raise
            logger.warning("Ray did not start (%s): trying again (%d)", error, attempt)


def forget_head(gcs: str) -> None:
    """Remove Ray's "current cluster" file when it names our stopped head: a later
    ``ray.init()`` on this machine would otherwise try to join it."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as file:
            if file.read().strip() == gcs:
                os.remove(path)
    except OSError:
        pass

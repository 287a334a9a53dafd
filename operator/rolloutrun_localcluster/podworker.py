"""One pod's life on the process kubelet: its directory, containers, restarts and status.

A worker runs the init containers one after another, then every container at once, each
as a process in its own session with the pod's environment, once its image "pulled"
(:mod:`.images`: ``ErrImagePull`` then ``ImagePullBackOff`` while it cannot). It restarts
containers per ``restartPolicy`` with the kubelet's exponential back-off
(``CrashLoopBackOff``; reset once a container ran twice the cap), runs readiness probes,
reports phase, conditions and ``containerStatuses`` through the pod's status subresource,
and on deletion sends SIGTERM to each container's main process (as a runtime signals a
container's PID 1), waits up to the grace period, then SIGKILLs everything the pod started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import cpucontrol, images, mountns, podspec, probes, processes
from .kubeconfig import private_dir, write_private
from .podspec import ConfigError, ContainerRecord
from .store import now_iso

if TYPE_CHECKING:
    from .kubelet import Kubelet

logger = logging.getLogger(__name__)

Obj = dict[str, Any]


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Until ``event`` is set or ``seconds`` passed. ``asyncio.timeout``, not ``wait_for``:
    Python 3.11's ``wait_for`` can swallow a cancellation (see :mod:`.probes`)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


class PodWorker:
    def __init__(self, kubelet: Kubelet, pod: Obj, ip: str) -> None:
        meta = pod["metadata"]
        self.kubelet = kubelet
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.ip = ip
        self.dir = kubelet.root / "pods" / self.namespace / f"{self.name}-{self.uid[:8]}"
        spec = pod.get("spec") or {}
        self.policy: str = spec.get("restartPolicy", "Always")
        self.spec: Obj = spec
        self.init_specs: list[Obj] = list(spec.get("initContainers") or [])
        self.main_specs: list[Obj] = list(spec.get("containers") or [])
        self.init = [ContainerRecord(c["name"], c.get("image", "")) for c in self.init_specs]
        self.main = [ContainerRecord(c["name"], c.get("image", "")) for c in self.main_specs]
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.sessions = processes.Sessions()
        self.initialized = not self.init_specs
        self.started_at = now_iso()
        self.terminating = asyncio.Event()
        self.finished = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ paths
    def log_path(self, container: str, previous: bool = False) -> Path:
        return self.dir / "logs" / (f"{container}.previous.log" if previous else f"{container}.log")

    @property
    def tag(self) -> str:
        return processes.pod_tag(self.uid)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pod-{self.namespace}-{self.name}")

    # ------------------------------------------------------------------ lifecycle
    async def _run(self) -> None:
        try:
            self._prepare()
            self.kubelet.cpu_admit(self, self.spec)
            await self.kubelet.network.attach(self)
            self.report()
            for spec, record in zip(self.init_specs, self.init, strict=True):
                if not await self._run_init(spec, record):
                    return
            self.initialized = True
            self.report()
            await asyncio.gather(
                *(
                    self._supervise(spec, record)
                    for spec, record in zip(self.main_specs, self.main, strict=True)
                )
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("pod %s/%s worker failed", self.namespace, self.name)
        finally:
            self.kill_processes_only()
            mountns.remove_tmp(self.dir)  # the pod's private /tmp dies with it
            with contextlib.suppress(Exception):
                await self.kubelet.network.detach(self)  # its address and links end here
            try:  # its CPU cgroup, once the processes killed above have exited
                await self.kubelet.cpu_release(self.uid)
            except Exception:
                logger.exception("pod %s/%s: removing its CPU cgroup", self.namespace, self.name)
            finally:
                self.finished.set()
                self.report()

    def _prepare(self) -> None:
        """The pod's directory, its owner's only (0700): it holds the token, the kubeconfig
        and the Secret volumes. No token at all when the pod or its ServiceAccount says
        ``automountServiceAccountToken: false``."""
        private_dir(self.dir.parent)
        private_dir(self.dir)
        (self.dir / "logs").mkdir(exist_ok=True)
        (self.dir / "work").mkdir(exist_ok=True)
        account = private_dir(self.dir / "serviceaccount")
        token = self.kubelet.token_for(self.kubelet.pod(self.uid) or {})
        if token is not None:
            write_private(account / "token", token.encode())
        else:
            (account / "token").unlink(missing_ok=True)
        write_private(account / "namespace", self.namespace.encode())
        write_private(account / "ca.crt", self.kubelet.ca_pem)
        kubeconfig = self.kubelet.kubeconfig_for(self.namespace, token)
        write_private(self.dir / "kubeconfig", kubeconfig.encode())
        self.kubelet.volumes.materialize(self)

    async def _run_init(self, spec: Obj, record: ContainerRecord) -> bool:
        while True:
            code = await self._run_container(spec, record)
            if code is None or self.terminating.is_set():
                return False
            if code == 0:
                record.will_restart = False
                return True
            record.will_restart = self.policy != "Never"
            self.report()
            if not record.will_restart:
                return False
            await self._back_off(record)

    async def _supervise(self, spec: Obj, record: ContainerRecord) -> None:
        while True:
            code = await self._run_container(spec, record)
            if code is None or self.terminating.is_set():
                record.will_restart = False
                self.report()
                return
            record.will_restart = podspec.should_restart(self.policy, code)
            self.report()
            if not record.will_restart:
                return
            await self._back_off(record)

    async def _back_off(self, record: ContainerRecord) -> None:
        delay = podspec.restart_delay(record, time.monotonic(), *self.kubelet.backoff)
        record.last_state = {"terminated": record.status()["state"]["terminated"]}
        record.state, record.reason, record.message = (
            "waiting",
            "CrashLoopBackOff",
            f"back-off {podspec.go_duration(delay)} restarting failed container={record.name} "
            f"pod={self.name}_{self.namespace}({self.uid})",
        )
        self.report()
        await _wait(self.terminating, delay)
        record.restart_count += 1
        log = self.log_path(record.name)
        if log.exists():
            log.replace(self.log_path(record.name, previous=True))

    def _env_for(self, spec: Obj) -> dict[str, str]:
        pod = self.kubelet.pod(self.uid)
        if pod is None:
            raise ConfigError("the pod is gone")
        status = {**(pod.get("status") or {}), "podIP": self.ip, "hostIP": self.kubelet.host_ip}
        pod = {**pod, "status": status}
        base = self.kubelet.base_env(self, spec)
        return podspec.container_env(
            pod, spec, self.kubelet.lookup("configmaps"), self.kubelet.lookup("secrets"), base
        )

    def _workdir(self, spec: Obj) -> Path:
        wanted = spec.get("workingDir")
        if not wanted:
            return self.dir / "work"
        if os.path.isdir(wanted):
            return Path(wanted)
        path = self.dir / "root" / wanted.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def _pull(self, spec: Obj, record: ContainerRecord) -> bool:
        """Pull the container's image: True once it pulled, False if the pod is going away.

        A failed pull is reported as the kubelet does (``ErrImagePull`` with the runtime's
        error; at the pod's next sync, a second later, ``ImagePullBackOff`` until the
        back-off ran out), then tried again."""
        image = str(spec.get("image", ""))
        policy = str(spec.get("imagePullPolicy", "IfNotPresent"))
        base, cap = self.kubelet.image_backoff
        failures = 0
        while not self.terminating.is_set():
            await self.kubelet.node_up()
            failure = self.kubelet.images.pull(image, policy)
            if failure is None:
                return True
            failures += 1
            delay = podspec.next_delay(base, cap, failures)
            record.state, record.reason, record.message = "waiting", failure.reason, failure.message
            self.report()
            sync = min(delay / 2, 1.0)  # the pod's next sync: a second, or half a short delay
            await _wait(self.terminating, sync)
            if failure.retried and not self.terminating.is_set():
                record.reason = "ImagePullBackOff"
                record.message = images.backoff_message(image, failure)
                self.report()
            await _wait(self.terminating, delay - sync)
        return False

    async def _run_container(self, spec: Obj, record: ContainerRecord) -> int | None:
        """Run the container once; its exit code, or ``None`` if the pod is going away."""
        if not await self._pull(spec, record):
            return None
        while True:
            if self.terminating.is_set():
                return None
            try:
                env = self._env_for(spec)
                break
            except ConfigError as error:
                record.state, record.reason, record.message = (
                    "waiting",
                    "CreateContainerConfigError",
                    str(error),
                )
                self.report()
                await _wait(self.terminating, 1.0)
        argv = podspec.container_argv(spec, env)
        env[processes.CONTAINER_TAG] = f"{self.uid}/{record.name}"
        executable = None
        if argv:
            executable = (
                argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", ""))
            )
        if executable is None:
            why = (
                f'exec: "{argv[0]}": executable file not found in $PATH'
                if argv
                else "no command specified: the local cluster runs command/args, "
                "images have no entrypoint"
            )
            return self._terminated(record, 128, "StartError", why)
        try:
            command, cwd = [executable, *argv[1:]], self._workdir(spec)
            if self.kubelet.isolation == mountns.NAMESPACES:
                command, cwd = self.kubelet.volumes.namespaced(self, spec, env, command)
            # The network prefix outside the mount namespace's: it names /run/netns/... as the
            # machine sees it.
            command = [*self.kubelet.network.argv_prefix(self.uid), *command]
            # The cgroup outermost: the container's process joins it before anything runs.
            command = [*self.kubelet.cpu_prefix(self.uid), *command]
            process = await processes.spawn(command, cwd, env, self.log_path(record.name))
        except (OSError, ConfigError) as error:
            return self._terminated(record, 128, "StartError", str(error))
        self.processes[record.name] = process
        self.sessions.add(process.pid)
        if self.terminating.is_set():  # deleted while it started: terminate() missed it
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        record.state, record.reason, record.message = "running", "", ""
        record.pid, record.started_at, record.exit_code = process.pid, now_iso(), 0
        record.ready = "readinessProbe" not in spec
        probe_task = None
        if "readinessProbe" in spec:
            probe_task = asyncio.create_task(self._probe(spec, record, env, process))
        self.report()
        try:
            returncode = await process.wait()
        finally:
            if probe_task is not None:
                probe_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe_task
        await self.kubelet.node_up()
        processes.kill_tagged(processes.container_tag(self.uid, record.name), [process.pid])
        self.processes.pop(record.name, None)
        code = podspec.exit_code_of(returncode)
        message = podspec.termination_message(spec, code, self._log_tail(record.name))
        return self._terminated(record, code, "Completed" if code == 0 else "Error", message)

    def _log_tail(self, container: str) -> bytes:
        try:
            with open(self.log_path(container), "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(log.tell() - 4 * podspec.TERMINATION_MESSAGE_BYTES, 0))
                return log.read()
        except OSError:
            return b""

    def _terminated(self, record: ContainerRecord, code: int, reason: str, message: str) -> int:
        record.state, record.exit_code, record.reason, record.message = (
            "terminated",
            code,
            reason,
            message,
        )
        record.finished_at, record.ready = now_iso(), False
        if not record.started_at:
            record.started_at = record.finished_at
        return code

    async def _probe(
        self, spec: Obj, record: ContainerRecord, env: dict[str, str], process: Any
    ) -> None:
        """Probe readiness while ``process`` (the container's main process) runs. The loop
        also ends by itself once the process exited: its task is awaited before the pod can
        finish, so a cancellation lost anywhere in a probe must not keep it alive."""
        probe = spec["readinessProbe"]
        tracker = probes.ReadinessTracker(probe)
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        period = max(float(probe.get("periodSeconds", 10)), self.kubelet.min_probe_period)
        while process.returncode is None:
            await self.kubelet.node_up()
            inside = (
                [
                    *self.kubelet.network.argv_prefix(self.uid),
                    *mountns.enter_prefix(process.pid, self.kubelet.isolation),
                ]
                if "exec" in probe
                else []
            )
            ok = await probes.probe_once(
                probe,
                spec,
                self.ip,
                env,
                self._workdir(spec),
                inside,
                dial=self.kubelet.network.dialer(),
            )
            if tracker.record(ok):
                record.ready = tracker.ready
                self.report()
            await asyncio.sleep(period)

    # ------------------------------------------------------------------ termination
    async def terminate(self, grace: float) -> None:
        """SIGTERM each container's main process; SIGKILL all after ``grace`` seconds."""
        if not self.terminating.is_set():
            self.terminating.set()
            for process in list(self.processes.values()):
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        await _wait(self.finished, grace)
        self.kill()
        await self.finished.wait()

    def kill(self) -> None:
        """SIGKILL everything the pod started, now."""
        self.terminating.set()
        self.kill_processes_only()

    def kill_processes_only(self) -> None:
        """SIGKILL the pod's processes without ending the pod (a node that crashed): those
        tagged or in its sessions, and those in its CPU cgroup."""
        processes.kill_tagged(self.tag, self.sessions)
        processes.signal_pids(self.kubelet.cpu_pids(self.uid), signal.SIGKILL)

    def freeze(self, frozen: bool) -> None:
        processes.freeze_tagged(self.tag, self.sessions, frozen)

    # ------------------------------------------------------------------ status
    def status(self, old: Obj) -> Obj:
        records = self.init + self.main
        phase = podspec.pod_phase(self.init, self.main, self.policy)
        ready = phase == "Running" and all(r.state == "running" and r.ready for r in self.main)
        now = now_iso()
        status: Obj = {
            "phase": phase,
            "conditions": podspec.conditions(
                old.get("conditions") or [],
                scheduled=True,
                initialized=self.initialized,
                ready=ready,
                now=now,
            ),
            "hostIP": self.kubelet.host_ip,
            "hostIPs": [{"ip": self.kubelet.host_ip}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.started_at,
            "qosClass": cpucontrol.qos_class(self.spec),
            "containerStatuses": [r.status() for r in self.main],
        }
        if self.init:
            status["initContainerStatuses"] = [r.status() for r in self.init]
        if not records:
            status["phase"] = "Pending"
        return status

    def report(self) -> None:
        self.kubelet.report(self)

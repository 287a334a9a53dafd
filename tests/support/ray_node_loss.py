"""A worker pod deleted as the kubelet deletes it, on a real two-node Ray: how the driver
learns that the pod's actor died.

In a network namespace the test creates (as :mod:`tests.support.ray_multinode`): a Ray head
on 127.0.0.2 (the trainer pod's address; this process is its driver) and one worker node on
127.0.0.3 started by the runtime's own entry point (:mod:`rolloutrun_runtime.workers.ray_node`,
the worker pod's process, in its own session as a container's). An actor that asks for the
generation resource lands there; a call that never returns (the trainers' watch) is in
flight. Then the pod is deleted as the local kubelet does it: SIGTERM to the container's
main process, and once that process has ended (or after the grace period) SIGKILL to
everything the pod started. The watch's error is what the driver was told: its message
names the cause Ray recorded for the node's death (the node's own termination, or the
GCS's health checks giving up on a silent node). One JSON line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.ray_multinode import RAY_ENV, run_in_namespace

HEAD_IP = "127.0.0.2"
WORKER_IP = "127.0.0.3"
#: The worker pods' grace period (the operator's default): SIGKILL of what is left after it.
GRACE_S = 30.0


def run(tmp: Path, timeout_s: float) -> dict[str, Any]:
    """:func:`main` in a fresh network namespace; its JSON result."""
    return run_in_namespace(tmp, timeout_s, module=__name__)


def _delete_pod(node: subprocess.Popen[bytes]) -> None:
    """The local kubelet's deletion: SIGTERM the main process; once it ends (bounded by the
    grace period), SIGKILL the pod's session (what the container left running)."""
    node.send_signal(signal.SIGTERM)
    try:
        node.wait(timeout=GRACE_S)
    finally:
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _lose_actor(tmp: Path) -> dict[str, Any]:
    import ray

    from rolloutrun_runtime.contract.pod import RAY_GCS_PORT, RAY_GENERATION_RESOURCE
    from rolloutrun_runtime.workers.ray_cluster import head_argv, node_env, wait_for_port

    env = node_env()
    head = subprocess.Popen(
        [*head_argv(HEAD_IP), "--num-cpus=1"],
        env=env,
        stdout=(tmp / "head.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for_port(HEAD_IP, RAY_GCS_PORT, 300, alive=lambda: head.poll() is None)
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutrun_runtime.workers.ray_node",
            f"--address={HEAD_IP}:{RAY_GCS_PORT}",
            f"--node-ip={WORKER_IP}",
            "--slots=1",
            "--num-cpus=1",
            "--num-gpus=0",
        ],
        stdout=(tmp / "node.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        ray.init(address=f"{HEAD_IP}:{RAY_GCS_PORT}", logging_level=logging.ERROR)

        @ray.remote(num_cpus=0)
        class Member:
            def where(self) -> str:
                return str(ray.util.get_node_ip_address())

            async def watch(self) -> None:
                await asyncio.Event().wait()

        actor = Member.options(resources={RAY_GENERATION_RESOURCE: 1}).remote()  # type: ignore[attr-defined]
        where = await actor.where.remote()
        running = _session_commands(node.pid)
        watch = asyncio.ensure_future(_awaited(actor.watch.remote()))
        await asyncio.sleep(0.5)
        deleted = time.monotonic()
        await asyncio.to_thread(_delete_pod, node)
        try:
            await asyncio.wait_for(watch, 120)
            error = "no error"
        except ray.exceptions.RayActorError as lost:
            error = str(lost)
        return {
            "actor_node_ip": where,
            "pod_exit_code": node.returncode,
            "node_processes": running,
            "error": error,
            "seconds": round(time.monotonic() - deleted, 3),  # reported, never asserted
        }
    finally:
        ray.shutdown()
        for process in (node, head):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _session_commands(session: int) -> list[str]:
    """The command lines of the processes of the worker pod's session."""
    import psutil

    commands = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(process.info["pid"]) == session:
                commands.append(" ".join(process.info["cmdline"] or []))
        except (ProcessLookupError, PermissionError):
            continue
    return commands


async def _awaited(ref: Any) -> Any:
    return await ref


def main(tmp: Path) -> None:
    os.environ.update(RAY_ENV)
    print(json.dumps(asyncio.run(_lose_actor(tmp))), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""A worker pod's Ray node, started as the pod starts it, asked for an actor with a
``runtime_env``: its placeholder runtime-env agent refuses it by name. One JSON line."""

from __future__ import annotations

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
from tests.support.ray_node_loss import HEAD_IP, WORKER_IP, session_commands

#: How long the refused actor's creation may take to fail (a hang guard, never a goal).
REFUSAL_S = 120.0


def run(tmp: Path, timeout_s: float) -> dict[str, Any]:
    """:func:`main` in a fresh network namespace; its JSON result."""
    return run_in_namespace(tmp, timeout_s, module=__name__)


def _probe(tmp: Path) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rolloutrun_runtime.contract.pod import RAY_GCS_PORT, RAY_GENERATION_RESOURCE
    from rolloutrun_runtime.workers.ray_cluster import head_argv, node_env, wait_for_port

    head = subprocess.Popen(
        [*head_argv(HEAD_IP), "--num-cpus=1"],
        env=node_env(),
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
            def where(self) -> tuple[str, str]:
                context = ray.get_runtime_context()
                return str(ray.util.get_node_ip_address()), context.get_node_id()

            def env(self) -> str | None:
                return os.environ.get("PROBE")

        plain = Member.options(resources={RAY_GENERATION_RESOURCE: 1}).remote()  # type: ignore[attr-defined]
        where, node_id = ray.get(plain.where.remote(), timeout=300)
        on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
        asked = time.monotonic()
        with_env = Member.options(  # type: ignore[attr-defined]
            scheduling_strategy=on_node, runtime_env={"env_vars": {"PROBE": "1"}}
        ).remote()
        try:
            error = f"no error: {ray.get(with_env.env.remote(), timeout=REFUSAL_S)!r}"
        except Exception as refused:  # what the driver is told, whatever its class
            error = f"{type(refused).__name__}: {refused}"
        return {
            "plain_actor_node_ip": where,
            "node_processes": session_commands(node.pid),
            "error": error,
            "seconds": round(time.monotonic() - asked, 3),  # reported, never asserted
            "plain_still_serves": ray.get(plain.where.remote(), timeout=60)[0] == where,
        }
    finally:
        ray.shutdown()
        for process in (node, head):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def main(tmp: Path) -> None:
    os.environ.update(RAY_ENV)
    print(json.dumps(_probe(tmp)), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

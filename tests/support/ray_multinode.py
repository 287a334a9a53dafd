"""A real multi-node Ray on one machine: a trainer (the head) and two worker nodes, each on
its own address inside a network namespace the test creates.

Why a namespace: Ray's GCS and raylets listen on every interface; inside a private network
namespace "every interface" is that namespace's loopback, where 127.0.0.2 (the trainer's
pod address), 127.0.0.3 and 127.0.0.4 (the worker pods') are three addresses of one
machine. :func:`run_in_namespace` runs this module's ``main`` there: worker nodes started by
the runtime's own entry point (:mod:`rolloutrun_runtime.workers.ray_node`), a Gym, and a
short ``run_trainer`` whose generation actors must land on the worker nodes; it prints one
JSON line with where they served and what the run trained. Each worker node offers one GPU
(``--num-gpus=1``: Ray counts it, nothing computes on it) and the second joins only after
the trainer's driver has connected, as a worker pod that pulls its image late: the GPUs
each actor asks for must be read from the joined worker nodes, not from the head alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HEAD_IP = "127.0.0.2"
WORKER_IPS = ("127.0.0.3", "127.0.0.4")
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # 0 refuses any multi-node cluster
}


def namespace_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2"
    return None


def run_in_namespace(tmp: Path, timeout_s: float, module: str = __name__) -> dict[str, Any]:
    """Run ``module``'s ``main`` (default: this one's) in a fresh network namespace; its JSON
    result."""
    name = f"rr-raytest-{os.getpid()}"
    temp_root = tempfile.mkdtemp(prefix="rr-ray-", dir="/tmp")
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        # Ray's temp root of our own: its "current cluster" file must not send another
        # test's ray.init() to our head (short: Ray's socket paths are bounded).
        env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": temp_root}
        command = ["ip", "netns", "exec", name, sys.executable, "-m", module, str(tmp)]
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise AssertionError(
                f"multi-node run failed ({done.returncode}): {done.stderr[-4000:]}"
            )
        return dict(json.loads(lines[-1]))
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)
        shutil.rmtree(temp_root, ignore_errors=True)


class _Placements(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.placements: list[Any] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Ray generation workers at"):
            self.placements = list(record.args[1]) if isinstance(record.args, tuple) else []


async def _train(tmp: Path) -> dict[str, Any]:
    from rolloutrun_runtime.contract.run_config import RunConfig
    from rolloutrun_runtime.environments.gym import GymServer
    from rolloutrun_runtime.policy.http import serve_app
    from rolloutrun_runtime.trainer import run_trainer

    cfg = RunConfig.model_validate(
        {
            "name": "ray-nodes",
            "seed": 5,
            "logDir": str(tmp / "run"),
            "policy": {
                "dModel": 32,
                "nLayers": 1,
                "nHeads": 2,
                "maxSeqLen": 32,
                "device": "auto",  # an actor asks for the worker nodes' GPUs
            },
            "task": {"name": "arithmetic", "datasetSize": 64, "maxNewTokens": 4},
            "grpo": {"groupSize": 4, "promptsPerStep": 2, "maxSteps": 2, "maxStaleness": 1},
            "checkpointing": {"savePeriod": 2},
            "gym": {"replicas": 1},
            "workers": {"backend": "ray", "generationWorkers": 2, "workerNodes": 2},
        }
    )
    server = GymServer("gym-0", cfg, None)
    runner, url = await serve_app(server.app)
    try:
        cfg = cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"endpoints": [url]})})
        result = await run_trainer(cfg)
    finally:
        await runner.cleanup()
    return {"steps": result.steps, "history": [r["step"] for r in result.history]}


def main(tmp: Path) -> None:
    from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN, ENV_POD_IP, RAY_GCS_PORT

    os.environ.update(RAY_ENV)
    os.environ.setdefault(ENV_GYM_TOKEN, "multi-node-test-token")
    os.environ[ENV_POD_IP] = HEAD_IP  # the trainer's pod address: its Ray head binds it
    handler = _Placements()
    logging.getLogger("rolloutrun_runtime.workers.ray_workers").addHandler(handler)
    logging.getLogger("rolloutrun_runtime.workers.ray_workers").setLevel(logging.INFO)

    def start_node(ip: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rolloutrun_runtime.workers.ray_node",
                f"--address={HEAD_IP}:{RAY_GCS_PORT}",
                f"--node-ip={ip}",
                "--slots=1",
                "--num-cpus=1",
                "--num-gpus=1",
            ],
            stdout=(tmp / f"node-{ip}.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    first, late = WORKER_IPS
    nodes = [start_node(first)]
    stop = threading.Event()

    def join_late() -> None:  # once the trainer's driver is connected to its head
        import ray

        while not ray.is_initialized():
            if stop.wait(0.1):
                return
        nodes.append(start_node(late))

    joiner = threading.Thread(target=join_late, daemon=True)
    joiner.start()
    try:
        trained = asyncio.run(_train(tmp))
    finally:
        stop.set()
        joiner.join()
        for node in nodes:  # the head is gone: a graceful stop would wait on it
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait()
    print(json.dumps({**trained, "placements": handler.placements}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""A generation-worker pod's process: wait for the trainer's Ray head, then join it.

Why a small entry point rather than ``ray start`` in the pod spec: the worker pod is created
as soon as the trainer pod has an address, before the trainer has started its head, and
``ray start --address`` gives up when the GCS is slow to take it; this waits (bounded) for
the GCS to answer, then runs ``ray start ... --block`` (arguments spelled once in
:func:`rolloutrun_runtime.contract.pod.ray_worker_node_argv`; run by :mod:`.ray_boot`,
which starts the node as Ray's CLI would but without it and with a placeholder for Ray's
dashboard agent: ~1.5 CPU-s less per refill pod), again when it failed to
start, at most :data:`START_ATTEMPTS` times, then ends with a message naming the failure.
Whether a node started is read from what ``ray start`` prints (:data:`STARTED_LINE`), not
from how long it ran: on a loaded machine a start that misses Ray's fixed 30 s bound for
its raylet to register ("The current node timed out during startup") can run past any
duration we could pick, and a pod that ended on it was replaced again by the operator (5
replacements for 3 deleted pods). A node that started and then ended (its head gone) ends
the process: the operator replaces the pod. A stop (SIGTERM, the pod deleted) is
forwarded to the node, and ends this process within :data:`STOP_GRACE_S` whether the node
ended or not: ``ray start --block`` can take the pod's whole grace period (30 s) to drain,
and the operator creates the replacement (same name) only once the pod is gone, while a
worker node holds nothing to save (the container's end takes its remaining processes).
The node is started without Ray's SIGTERM drain (:data:`NODE_STOP_ENV`), so the stop
reaches its raylet at once and the raylet unregisters: the head's GCS reports the pod's
actors dead within a fraction of a second, naming the node's SIGTERM, where before the
drain outlived :data:`STOP_GRACE_S`, the raylet was SIGKILLed and the trainer learnt of
the loss only when the GCS's health checks gave up on it (~3-5 s after the deletion).

    python -m rolloutrun_runtime.workers.ray_node --address HOST:PORT --slots N [--num-gpus G]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import IO

from rolloutrun_runtime.contract.pod import (
    ENV_GYM_TOKEN,
    ENV_POD_IP,
    ray_auth_token,
    ray_worker_node_argv,
)
from rolloutrun_runtime.workers.ray_cluster import (
    NODE_START_TIMEOUT_S,
    STARTED_LINE,
    RayClusterError,
    node_env,
    parse_address,
    wait_for_port,
)

#: Starts the worker node as ``ray start`` would, in one process, with Ray's dashboard agent
#: replaced by a placeholder (:mod:`.ray_boot`).
BOOT_MODULE = "rolloutrun_runtime.workers.ray_boot"
#: ``ray start`` tries before the pod gives up, and the pause between two.
START_ATTEMPTS = 5
RETRY_PAUSE_S = 2.0
#: Seconds a stopped node gets to end before this process ends without it.
STOP_GRACE_S = 2
#: A worker node's ``ray start`` on SIGTERM: no drain (Ray's default waits up to 30 s for
#: the node to go idle, which a node whose actor serves never does), so it stops its raylet
#: at once with SIGTERM; the raylet then unregisters from the GCS, which reports its actors
#: dead right away ("received SIGTERM") instead of when its health checks give up on a
#: node that went silent under this process's SIGKILL (seconds later).
NODE_STOP_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def worker_argv(
    address: str, node_ip: str, slots: int, num_cpus: int | None, num_gpus: int | None = None
) -> list[str]:
    """The worker node's ``ray start`` arguments, run by :mod:`.ray_boot` (the refill pod's
    start-up CPU, issue 14)."""
    parsed = parse_address(address)
    args = ray_worker_node_argv(parsed.gcs, node_ip, slots, num_cpus, num_gpus)
    return [sys.executable, "-m", BOOT_MODULE, *args]


def main(argv: list[str] | None = None) -> int:
    # The run's token only derives the cluster's Ray token: no Ray process inherits it.
    run_token = os.environ.pop(ENV_GYM_TOKEN, None)
    auth_token = ray_auth_token(run_token) if run_token else None
    parser = argparse.ArgumentParser(prog="python -m rolloutrun_runtime.workers.ray_node")
    parser.add_argument("--address", required=True, help="the head's GCS address host:port")
    parser.add_argument("--slots", type=int, default=1, help="generation slots offered")
    parser.add_argument("--node-ip", default=os.environ.get(ENV_POD_IP) or None)
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--num-gpus", type=int, default=None, help="default: as detected")
    parser.add_argument("--wait-s", type=float, default=NODE_START_TIMEOUT_S)
    args = parser.parse_args(argv)
    if not args.node_ip:
        parser.error(f"--node-ip is required (or ${ENV_POD_IP})")
    if args.slots < 1:
        parser.error("--slots must be at least 1")
    try:
        parsed = parse_address(args.address)
        wait_for_port(parsed.host, parsed.port, args.wait_s)
    except RayClusterError as error:
        print(f"ray_node: {error}", file=sys.stderr)
        return 1
    command = worker_argv(args.address, args.node_ip, args.slots, args.num_cpus, args.num_gpus)
    return run_node(command, parsed.host, parsed.port, args.wait_s, auth_token)


def should_retry(code: int, stopping: bool, started: bool, attempt: int) -> bool:
    """Whether a ``ray start`` that ended with ``code`` is run again: only one that never
    started (no :data:`STARTED_LINE`), was not stopped, and left tries."""
    return code != 0 and not stopping and not started and attempt < START_ATTEMPTS


def _relay(stream: IO[bytes], started: threading.Event) -> None:
    """The node's output to ours, line by line, noting when it says it started."""
    for line in iter(stream.readline, b""):
        if STARTED_LINE in line:
            started.set()
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()


def run_node(
    command: list[str], host: str, port: int, wait_s: float, auth_token: str | None = None
) -> int:
    """``command`` until it ends after having started, or fails to start too often."""
    child: subprocess.Popen[bytes] | None = None
    stopping: list[int] = []  # the stop signal received: the node is not started again

    def forward(signum: int, _frame: FrameType | None) -> None:
        if child is None or child.poll() is not None:
            sys.exit(128 + signum)
        stopping.append(signum)
        child.send_signal(signum)
        signal.signal(signal.SIGALRM, lambda _s, _f: sys.exit(128 + signum))
        signal.alarm(STOP_GRACE_S)  # a second signal re-arms it: still bounded

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 1
    for attempt in range(1, START_ATTEMPTS + 1):
        wait_for_port(host, port, wait_s)
        started = threading.Event()
        child = subprocess.Popen(
            command,
            env={**node_env(auth_token=auth_token), **NODE_STOP_ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert child.stdout is not None
        relay = threading.Thread(target=_relay, args=(child.stdout, started), daemon=True)
        relay.start()
        code = child.wait()
        relay.join(1.0)  # the rest of its output (a grandchild may hold the pipe: bounded)
        if not should_retry(code, bool(stopping), started.is_set(), attempt):
            break
        print(f"ray_node: ray start failed ({code}), try {attempt}/{START_ATTEMPTS}", flush=True)
        time.sleep(RETRY_PAUSE_S)
    if stopping:  # stopped (the pod deleted): ended as by the signal, whatever Ray's code
        return 128 + stopping[0]
    if code != 0 and not started.is_set():
        print(
            f"ray_node: ray start failed {START_ATTEMPTS} times (last exit code {code}); "
            "the Ray node never started",
            file=sys.stderr,
            flush=True,
        )
    return code


if __name__ == "__main__":
    sys.exit(main())

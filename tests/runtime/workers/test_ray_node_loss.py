"""A deleted worker pod's actor is reported dead by the pod's own termination, not by the
GCS's health checks giving up on a silent node.

On SIGTERM the worker pod's process stops its Ray node without Ray's drain (which waits up
to 30 s for a node whose actor serves to go idle, longer than the pod's process waits for
it): the raylet gets SIGTERM at once and unregisters, and the driver's error names that
("terminated expectedly: received SIGTERM"). Before, the drain outlived the process, the
kubelet SIGKILLed the raylet, and the death was reported only when the health checks gave
up on it, with no cause ("died unexpectedly", ~3-5 s after the deletion).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutrun_runtime.workers.ray_node import NODE_STOP_ENV
from tests.support.ray_multinode import namespace_unavailable
from tests.support.ray_node_loss import WORKER_IP, run

#: The stand-in node: prints the drain setting it was started with.
PRINT_DRAIN = "import os; print(os.environ.get('RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S'))"


def test_the_worker_node_is_started_without_rays_sigterm_drain(tmp_path: Path) -> None:
    import socket

    listener = socket.create_server(("127.0.0.1", 0))  # the "head's GCS" run_node waits for
    port = listener.getsockname()[1]
    script = (
        "import sys; from rolloutrun_runtime.workers.ray_node import run_node; "
        f"sys.exit(run_node([sys.executable, '-c', {PRINT_DRAIN!r}], '127.0.0.1', {port}, 10))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    finally:
        listener.close()
    assert done.stdout.strip() == NODE_STOP_ENV["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"


@pytest.mark.chaos  # a head and a worker node: ~20-40 s on a shared machine
@pytest.mark.timeout(600)
@pytest.mark.skipif(namespace_unavailable() is not None, reason=str(namespace_unavailable()))
def test_a_deleted_worker_pods_actor_is_reported_dead_by_its_nodes_sigterm(
    tmp_path: Path,
) -> None:
    result = run(tmp_path, timeout_s=540)
    assert result["actor_node_ip"] == WORKER_IP  # the actor was on the worker pod's node
    commands = result["node_processes"]
    assert any("raylet" in command for command in commands)
    assert not any("log_monitor" in command for command in commands)  # nobody reads it
    # Ray's dashboard agent replaced by its placeholder (workers/ray_boot.py)
    assert any("ray_agent_stub.py" in command for command in commands)
    assert not any("dashboard/agent.py" in command for command in commands)
    # before: "The actor died unexpectedly before finishing this task." and nothing on the
    # node: the GCS's health checks found the SIGKILLed raylet silent
    assert "the actor's node was terminated expectedly: received SIGTERM" in result["error"]
    assert result["pod_exit_code"] == 128 + signal.SIGTERM  # ended as by the signal

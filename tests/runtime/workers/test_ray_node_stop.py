"""A worker pod's stop: SIGTERM is forwarded to its Ray node, and the pod's process ends
within :data:`~rolloutrun_runtime.workers.ray_node.STOP_GRACE_S` even when the node does
not (``ray start --block`` draining), so a deleted worker pod is gone in seconds rather than
after its whole grace period (the replacement, same name, is created only then).

A real process runs :func:`run_node` with a node command that ignores SIGTERM and would run
for a minute (a node that does not end promptly)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

#: The stand-in node: ignores SIGTERM, says it is running, sleeps a minute.
NODE = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('node up', flush=True); time.sleep(60)"
)
#: Only a hang guard: far below the stand-in node's minute, far above STOP_GRACE_S.
HANG_S = 30


def test_a_stopped_worker_node_ends_the_pods_process_without_waiting_for_the_node() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # the "head's GCS" run_node waits for
    port = listener.getsockname()[1]
    script = (
        "import sys; from rolloutrun_runtime.workers.ray_node import run_node; "
        f"sys.exit(run_node([sys.executable, '-c', {NODE!r}], '127.0.0.1', {port}, 10.0))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "node up"
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=HANG_S)  # before: it waited for the node (a minute)
        assert code == 128 + signal.SIGTERM
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the stand-in node, left by design
        except ProcessLookupError:
            pass
        process.wait()
        listener.close()

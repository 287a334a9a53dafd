"""A worker pod's ``ray start`` that never started its node is tried again (bounded), however
long it ran; one that started and then ended is not: whether a node started is what ``ray
start`` says (:data:`~rolloutrun_runtime.workers.ray_node.STARTED_LINE`), not how long it
ran. Before, a start that failed after running longer than a fixed bound (Ray's 30 s bound
for its raylet to register, missed on a loaded machine, plus Ray's start-up) was taken for a
node that had started, the pod ended, and the operator replaced it again (5 replacements
for 3 deleted worker pods).

Real processes run :func:`run_node` with stand-in node commands."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutrun_runtime.workers import ray_node

#: A ``ray start`` that fails after running longer than the old "it had started" bound
#: (lowered to 0.2 s below, so the test takes a second, not minutes).
NEVER_STARTS = "import time, sys; time.sleep(0.5); print('timed out during startup'); sys.exit(1)"
#: A node that started, then ended (its head gone).
STARTS_THEN_ENDS = "import sys; print('Ray runtime started.', flush=True); sys.exit(1)"
HANG_S = 60


def _run(tmp_path: Path, node: str) -> tuple[int, int, str]:
    """``run_node`` on ``node`` in its own process; returns its exit code, how many times
    it ran the node, and its stderr."""
    listener = socket.create_server(("127.0.0.1", 0))  # the "head's GCS"
    port = listener.getsockname()[1]
    tries = tmp_path / "tries"
    counted = f"open({str(tries)!r}, 'a').write('x'); " + node
    script = (
        "import sys; from rolloutrun_runtime.workers import ray_node as n; "
        "n.STARTED_AFTER_S = 0.2; n.RETRY_PAUSE_S = 0.01; "
        f"sys.exit(n.run_node([sys.executable, '-c', {counted!r}], '127.0.0.1', {port}, 10.0))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S
        )
    finally:
        listener.close()
    return done.returncode, len(tries.read_text()), done.stderr


def test_a_start_that_never_started_is_tried_again_then_fails_by_name(tmp_path: Path) -> None:
    code, tries, stderr = _run(tmp_path, NEVER_STARTS)
    assert code == 1
    assert tries == ray_node.START_ATTEMPTS  # before: 1 (taken for a node that had started)
    assert f"ray start failed {ray_node.START_ATTEMPTS} times" in stderr
    assert "never started" in stderr


def test_a_node_that_started_then_ended_is_not_started_again(tmp_path: Path) -> None:
    code, tries, _ = _run(tmp_path, STARTS_THEN_ENDS)
    assert (code, tries) == (1, 1)


@pytest.mark.parametrize(
    ("code", "stopping", "started", "attempt", "retry"),
    [
        (1, False, False, 1, True),
        (1, False, False, ray_node.START_ATTEMPTS, False),  # bounded
        (1, False, True, 1, False),  # it had started: its end is the pod's
        (1, True, False, 1, False),  # stopped: the pod is going
        (0, False, False, 1, False),
    ],
)
def test_should_retry(code: int, stopping: bool, started: bool, attempt: int, retry: bool) -> None:
    assert ray_node.should_retry(code, stopping, started, attempt) is retry

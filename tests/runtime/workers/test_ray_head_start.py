"""The trainer's Ray head that ends after its GCS port opened: started again, or a named
error; never a ``ray.init`` that waits on the dead head.

Why: ``ray start --head`` opens the GCS port, then exits when its raylet misses Ray's fixed
30 s start bound (a loaded machine). The trainer used to take the open port for a started
head and call ``ray.init`` on it, which retried its connection for about a quarter of an
hour: the trainer hung instead of failing, and the operator restarted nothing.

Each test runs a real trainer-side :class:`RayConnection` in its own process (this session
may hold a Ray of its own) under a wrapper put before the head's real ``ray start`` argv
(``node_prefix``): it counts the starts, and on the first ``fail`` ones lets the port open
and then ends the node (a stand-in that listens then exits, or the real head killed as its
port opens)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.workers.ray_cluster import (
    NODE_START_ATTEMPTS,
    STARTED_AFTER_S,
    Readiness,
    readiness,
)

#: Only a hang guard: the stand-in head's three starts take seconds; before, ``ray.init``
#: on the dead head retried for about a quarter of an hour.
HANG_S = 150

#: The wrapper: ``wrapper.py COUNT FAIL MODE ARGV...``. Each start appends to COUNT; the
#: first FAIL starts end once the port is open: MODE ``stand-in`` listens on the port the
#: argv names and exits; ``kill`` runs the real node and kills its group as the port opens.
#: Later starts exec the real node.
WRAPPER = r"""
import os, signal, socket, subprocess, sys, time
count, fail, mode, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
with open(count, "a") as file:
    file.write("start\n")
starts = len(open(count).read().split())
if starts > fail:
    os.execv(argv[0], argv)
port = int(next(a for a in argv if a.startswith("--port=")).split("=")[1])
if mode == "stand-in":
    listener = socket.create_server(("127.0.0.1", port))
    time.sleep(0.5)
    sys.exit(1)
node = subprocess.Popen(argv, start_new_session=True)
while True:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.05)
os.killpg(node.pid, signal.SIGKILL)
sys.exit(1)
"""

TRAINER = r"""
import json, sys
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.workers.ray_cluster import RayClusterError, RayConnection
port, prefix = int(sys.argv[1]), tuple(sys.argv[2:])
cfg = RunConfig.model_validate({"workers": {"workerNodes": 1}})
connection = RayConnection(cfg, "127.0.0.1", head_port=port, node_prefix=prefix)
try:
    connection.open()
    import ray
    alive = [n for n in ray.nodes() if n["Alive"]]
    print(json.dumps({"kind": connection.kind, "nodes": len(alive)}))
except RayClusterError as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
finally:
    connection.close()
"""

#: The same connection, abandoned (a stop during the trainer's start) from another thread
#: once its first start has begun (the wrapper counted it).
ABANDONED = r"""
import json, os, sys, threading, time
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.workers.ray_cluster import RayClusterError, RayConnection
port, prefix = int(sys.argv[1]), tuple(sys.argv[2:])
cfg = RunConfig.model_validate({"workers": {"workerNodes": 1}})
connection = RayConnection(cfg, "127.0.0.1", head_port=port, node_prefix=prefix)
def abandon():
    while not os.path.exists(prefix[2]):
        time.sleep(0.01)
    connection.abandon()
threading.Thread(target=abandon, daemon=True).start()
try:
    connection.open()
    print(json.dumps({"kind": connection.kind}))
except RayClusterError as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
finally:
    connection.close()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _trainer(
    tmp_path: Path, fail: int, mode: str, script: str = TRAINER
) -> tuple[dict[str, Any], int]:
    """Run the trainer's connection against a head wrapped as above: (its result, starts)."""
    wrapper, count = tmp_path / "wrapper.py", tmp_path / "starts"
    wrapper.write_text(WRAPPER)
    prefix = [sys.executable, str(wrapper), str(count), str(fail), mode]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(_free_port()), *prefix],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,  # before the fix: TimeoutExpired (ray.init on the dead head)
        start_new_session=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result, len(count.read_text().split())


def test_a_head_that_always_ends_after_its_port_opened_is_a_named_error_not_a_hang(
    tmp_path: Path,
) -> None:
    result, starts = _trainer(tmp_path, fail=NODE_START_ATTEMPTS, mode="stand-in")
    assert starts == NODE_START_ATTEMPTS
    assert result["error"] == "RayNodeEndedError", result
    message = result["message"]
    assert "the trainer's Ray head node on 127.0.0.1 ended before the driver connected" in message
    assert f"{NODE_START_ATTEMPTS} starts in a row" in message and "exit status 1" in message


def test_an_abandoned_start_gives_up_instead_of_starting_its_head_again(tmp_path: Path) -> None:
    """A stop during the trainer's start: its head (SIGTERM'd with the pod) ended, and the
    start, in its own thread, used to start it again while the process waited to exit."""
    result, starts = _trainer(tmp_path, fail=NODE_START_ATTEMPTS, mode="stand-in", script=ABANDONED)
    assert starts == 1  # before: NODE_START_ATTEMPTS (then a RayNodeEndedError)
    assert result["error"] == "RayClusterError", result
    assert "the Ray head node's start was abandoned" in result["message"]


@pytest.mark.chaos  # a real Ray head started twice: about a minute on a shared machine
@pytest.mark.timeout(300)
def test_a_real_head_killed_as_its_port_opens_is_started_again_and_the_driver_connects(
    tmp_path: Path,
) -> None:
    result, starts = _trainer(tmp_path, fail=1, mode="kill")
    assert result == {"kind": "head", "nodes": 1}
    assert starts == 2


@pytest.mark.parametrize(
    ("said", "alive", "since", "state"),
    [
        (True, True, 0.0, Readiness.READY),
        (True, False, 0.0, Readiness.READY),  # it started; a later end is ray.init's to see
        (False, False, 1.0, Readiness.ENDED),
        (False, True, 1.0, Readiness.WAIT),  # an open port is not a started node
        (False, True, STARTED_AFTER_S, Readiness.READY),  # alive past Ray's own start bound
    ],
)
def test_a_node_has_started_when_it_says_so_or_outlives_rays_start_bound(
    said: bool, alive: bool, since: float, state: Readiness
) -> None:
    assert readiness(said, alive, since) is state

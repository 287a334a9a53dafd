"""A generation-worker pod's Ray node, started as ``ray start --address=... --block`` would,
with less of its CPU: no Ray CLI, and a placeholder for Ray's dashboard agent.

Why: a worker pod deleted every 15 s is replaced by a refill pod whose start runs on the
cores the trainer and the serving workers use (issue 14). Of its ~5.3 CPU-s
(``bench.worker_start_cpu``):

- Ray's dashboard agent took ~1.2: it imports every module under ``ray/dashboard/modules``
  (walked even in its minimal mode) to serve the dashboard, Ray's metrics and the job, log
  and profiling APIs of the node, none of which a worker node of ours is asked for (the
  trainer's head runs no dashboard, its driver reads no Ray metrics nor worker logs). Ray
  2.60 has no switch to leave it out: the raylet refuses an empty agent command ("Dashboard
  agent command must be non empty"), starts the agent itself, and waits for the ports the
  agent persists in the session directory. So the raylet's dashboard-agent command is
  replaced by :mod:`.ray_agent_stub` (stdlib only, no ``import ray``): it persists the
  three ports as a minimal agent with no HTTP server would (``-1``: not served) and lives
  as long as the raylet.
- ``ray start`` took ~0.9, about half of it importing Ray's CLI (its job, state and
  autoscaler commands). :func:`start_node` does what that CLI does for a node that is not
  the head (``RayParams``, ``Node``, Ray's own SIGTERM handling), in this process.

Everything else (the raylet, the runtime-env agent, the workers) is Ray's own. What this
relies on of Ray's internals is here only, checked against Ray :data:`RAY_VERSION_CHECKED`;
each assumption is verified when the node starts and a failed one ends the start with
:class:`RayBootError` naming it (the pod's entry point reports it, tries again and then
fails), never a silent full agent: the raylet's command carries exactly one
``--dashboard_agent_command=`` naming Ray's ``dashboard/agent.py``, Ray's port names and
port file names are the placeholder's (:func:`install`), and the node's start takes the
arguments Ray 2.60's did (:func:`start_node`).

    python -m rolloutrun_runtime.workers.ray_boot start --address=HOST:PORT ... --block
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rolloutrun_runtime.workers import ray_agent_stub
from rolloutrun_runtime.workers.ray_cluster import STARTED_LINE

#: The Ray release whose ``services.start_raylet`` and dashboard agent this was read against.
RAY_VERSION_CHECKED = "2.60.0"
#: The raylet's argument that carries the dashboard agent's command line (one string).
AGENT_FLAG = "--dashboard_agent_command="
#: How Ray's dashboard agent is named in that command (its script under the ``ray`` package).
RAY_AGENT_SCRIPT = os.path.join("dashboard", "agent.py")


class RayBootError(RuntimeError):
    """This Ray is not the one the agent replacement was checked against."""


def stub_agent_command(command: str, python: str = sys.executable) -> str:
    """Ray's dashboard-agent command line ``command`` with its interpreter and script
    replaced by :mod:`.ray_agent_stub` (Ray's arguments kept: the stub reads two)."""
    words = shlex.split(command)
    scripts = [i for i, word in enumerate(words) if word.endswith(RAY_AGENT_SCRIPT)]
    if len(scripts) != 1:
        raise RayBootError(
            f"Ray's dashboard agent command names {RAY_AGENT_SCRIPT} {len(scripts)} times "
            f"(expected once, as in Ray {RAY_VERSION_CHECKED}): {command!r}"
        )
    return subprocess.list2cmdline([python, ray_agent_stub.__file__, *words[scripts[0] + 1 :]])


def raylet_argv(argv: list[str]) -> list[str]:
    """The raylet's ``argv`` with its dashboard agent command replaced (see module)."""
    found = [i for i, arg in enumerate(argv) if arg.startswith(AGENT_FLAG)]
    if len(found) != 1:
        raise RayBootError(
            f"the raylet's command has {len(found)} {AGENT_FLAG!r} arguments (expected "
            f"one, as in Ray {RAY_VERSION_CHECKED})"
        )
    out = list(argv)
    out[found[0]] = AGENT_FLAG + stub_agent_command(argv[found[0]][len(AGENT_FLAG) :])
    return out


def check_port_files(filename: Callable[[str, str], str], names: tuple[str, ...]) -> None:
    """Ray's port file name (``filename(node_id, name)``) is the stub's for each port."""
    node = "0" * 56
    for name in names:
        if filename(node, name) != ray_agent_stub.port_filename(node, name):
            raise RayBootError(
                f"Ray names the {name!r} port file {filename(node, name)!r}, the agent stub "
                f"{ray_agent_stub.port_filename(node, name)!r} (checked on Ray "
                f"{RAY_VERSION_CHECKED})"
            )


def install() -> list[list[str]]:
    """Wrap Ray's ``services.start_ray_process`` so that the raylet it starts gets the stub
    agent; the port names and their files are checked first. Returns the raylet commands
    rewritten so far (one once the node started: :func:`main` checks it)."""
    import ray._private.ray_constants as ray_constants
    import ray._private.services as services
    import ray._raylet

    raylet: Any = ray._raylet  # compiled: its names are not in Ray's stubs

    names = (
        raylet.METRICS_AGENT_PORT_NAME,
        raylet.METRICS_EXPORT_PORT_NAME,
        raylet.DASHBOARD_AGENT_LISTEN_PORT_NAME,
    )
    if names != ray_agent_stub.PORT_NAMES:
        raise RayBootError(
            f"Ray's dashboard agent persists the ports {names}, the stub "
            f"{ray_agent_stub.PORT_NAMES} (checked on Ray {RAY_VERSION_CHECKED})"
        )
    check_port_files(raylet.get_port_filename, names)
    original = services.start_ray_process
    rewritten: list[list[str]] = []

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kw: Any) -> Any:
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = raylet_argv(command)
            rewritten.append(command)
        return original(command, process_type, *args, **kw)

    services.start_ray_process = start_ray_process
    return rewritten


def parse_start(argv: list[str]) -> argparse.Namespace:
    """The worker node's ``ray start`` arguments
    (:func:`~rolloutrun_runtime.contract.pod.ray_worker_node_argv`); any other is refused
    by name (this is not Ray's CLI, only the start of a worker node)."""
    parser = argparse.ArgumentParser(prog="python -m rolloutrun_runtime.workers.ray_boot")
    parser.add_argument("command", choices=["start"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--node-ip-address", required=True)
    parser.add_argument("--resources", type=json.loads, default={})
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--num-gpus", type=int, default=None)
    parser.add_argument("--disable-usage-stats", action="store_true")
    parser.add_argument("--block", action="store_true", required=True)
    parser.add_argument("--include-log-monitor", choices=["true", "false"], default="true")
    return parser.parse_args(argv)


def start_node(args: argparse.Namespace) -> Any:
    """What Ray 2.60's ``ray start --address=... --block`` does for a node that is not the
    head (``ray/scripts/scripts.py``), in this process: without importing Ray's CLI (its
    job, state and autoscaler commands: ~0.5 CPU-s of imports per refill pod)."""
    try:
        import ray._private.node as ray_node
        import ray._private.parameter as parameter
        import ray._private.services as services
        from ray._private.authentication.authentication_token_setup import (
            ensure_token_if_auth_enabled,
        )

        params = parameter.RayParams(
            node_ip_address=args.node_ip_address,
            node_name=args.node_ip_address,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            resources=args.resources,
            include_log_monitor=args.include_log_monitor == "true",
        )
        params.gcs_address = services.canonicalize_bootstrap_address(args.address, None)
        ensure_token_if_auth_enabled(None, create_token_if_missing=False)
        make_node: Callable[..., Any] = ray_node.Node
    except (ImportError, AttributeError, TypeError) as error:
        raise RayBootError(
            f"this Ray's node start differs from Ray {RAY_VERSION_CHECKED}'s: {error!r}"
        ) from error
    # Ray's own SIGTERM handling (shutdown_at_exit): its drain, then its processes stopped
    return make_node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)


def unexpected_exits(dead: list[tuple[str, Any]]) -> list[str]:
    """The node's processes that ended other than as stopped (Ray's CLI takes 0 and
    SIGTERM's codes as stopped)."""
    stopped = (0, signal.SIGTERM, -signal.SIGTERM, 128 + signal.SIGTERM)
    return [
        f"{kind} ({process.returncode})"
        for kind, process in dead
        if process.returncode not in stopped
    ]


def block(node: Any) -> int:
    """Until one of the node's processes ends unexpectedly (as ``ray start --block``); a
    stop (SIGTERM) ends this process in Ray's handler."""
    while True:
        time.sleep(1.0)
        if ended := unexpected_exits(node.dead_processes()):
            print(f"ray_boot: Ray processes ended: {', '.join(ended)}", flush=True)
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            return 1


def main(argv: list[str]) -> int:
    args = parse_start(argv)
    import ray

    if ray.__version__ != RAY_VERSION_CHECKED:  # the checks below decide; this says why
        print(f"ray_boot: Ray {ray.__version__}, checked on {RAY_VERSION_CHECKED}", flush=True)
    rewritten = install()
    node = start_node(args)
    if len(rewritten) != 1:  # a raylet started some other way would run Ray's full agent
        node.kill_all_processes(check_alive=False, allow_graceful=False)
        raise RayBootError(
            f"{len(rewritten)} raylets were started through services.start_ray_process "
            f"(one in Ray {RAY_VERSION_CHECKED}): its dashboard agent was not replaced"
        )
    print(STARTED_LINE.decode(), flush=True)
    return block(node)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

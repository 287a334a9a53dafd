"""``ray start`` for a generation-worker pod, with a placeholder for Ray's dashboard agent.

Why: a worker pod deleted every 15 s is replaced by a refill pod whose start runs on the
cores the trainer and the serving workers use (issue 14). Of its ~5.3 CPU-s, Ray's
dashboard agent took ~1.2 (``bench.worker_start_cpu``): it imports every module under
``ray/dashboard/modules`` (walked even in its minimal mode) to serve the dashboard, Ray's
metrics and the job, log and profiling APIs of the node, none of which a worker node of
ours is asked for (the trainer's head runs no dashboard, its driver reads no Ray metrics
nor worker logs). Ray 2.60 has no switch to leave the agent out: the raylet refuses an
empty agent command ("Dashboard agent command must be non empty"), starts the agent
itself, and waits for the ports the agent persists in the session directory.

So the raylet's dashboard-agent command is replaced by :mod:`.ray_agent_stub` (stdlib
only, no ``import ray``): it persists the three ports as a minimal Ray agent with no HTTP
server would (``-1``: not served) and lives as long as the raylet. Everything else
(the raylet, the runtime-env agent, the workers) is Ray's own, as ``ray start`` builds it.

The replacement is one wrapper around ``ray._private.services.start_ray_process`` in this
``ray start`` process only (the module runs Ray's own CLI after installing it), checked
against Ray :data:`RAY_VERSION_CHECKED`. Each assumption is verified when the node starts
and a failed one ends ``ray start`` with :class:`RayBootError` naming it (the pod's entry
point reports it and the pod fails), never a silent full agent: the raylet's command
carries exactly one ``--dashboard_agent_command=`` naming Ray's ``dashboard/agent.py``,
and Ray's port file names are the stub's (:func:`check_port_files`).

    python -m rolloutrun_runtime.workers.ray_boot start --address=HOST:PORT ... --block
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from rolloutrun_runtime.workers import ray_agent_stub

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


def install() -> None:
    """Wrap Ray's ``services.start_ray_process`` so that the raylet it starts gets the stub
    agent; the port names and their files are checked first."""
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

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kw: Any) -> Any:
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = raylet_argv(command)
        return original(command, process_type, *args, **kw)

    services.start_ray_process = start_ray_process


def main(argv: list[str]) -> int:
    install()
    from ray.scripts.scripts import main as ray_cli

    sys.argv = ["ray", *argv]
    return ray_cli()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

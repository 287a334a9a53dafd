"""What a worker node's raylet runs in place of Ray's dashboard agent (see :mod:`.ray_boot`).

Why a placeholder and not the agent: the raylet starts the command it is given, waits for
the agent's ports in the session directory and stops when the agent ends, but a worker
node of ours needs none of what the agent serves (dashboard, Ray metrics, log, job and
profiling APIs), and the agent's start (``import ray`` and every dashboard module) cost
each refill pod ~1.2 CPU-s on the cores the trainer uses. This persists the ports as Ray
2.60's agent does in minimal mode with no HTTP server (``-1``: not served, so the node's
workers export no metrics), then lives until the raylet that started it ends.

Run as a script by the raylet (``python .../ray_agent_stub.py --node-id=... --session-dir=...
<Ray's other agent arguments, ignored>``): the standard library only, nothing of Ray's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

#: The ports Ray's dashboard agent persists (``ray._raylet``'s ``*_PORT_NAME``; checked
#: against Ray by :func:`rolloutrun_runtime.workers.ray_boot.install`).
PORT_NAMES = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
#: The port value of a service the agent does not run (Ray's minimal agent writes it too).
NOT_SERVED = -1
#: Seconds between two looks at whether the raylet (our parent) is still there.
PARENT_POLL_S = 1.0


def port_filename(node_id: str, name: str) -> str:
    """Ray's name of a persisted port's file in the session directory (``persist_port``)."""
    return f"{name}_{node_id}"


def persist(session_dir: str, node_id: str, name: str, port: int) -> None:
    """``port`` in its file, whole or not at all (the raylet reads it as soon as it exists)."""
    path = os.path.join(session_dir, port_filename(node_id, name))
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as handle:
        handle.write(str(port))
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ray_agent_stub")
    parser.add_argument("--node-id", default=os.environ.get("RAY_NODE_ID"))
    parser.add_argument("--session-dir", required=True)
    args, _ray_arguments = parser.parse_known_args(argv)
    if not args.node_id:
        parser.error("--node-id (or $RAY_NODE_ID) is required")
    for name in PORT_NAMES:
        persist(args.session_dir, args.node_id, name, NOT_SERVED)
    raylet = os.getppid()
    while os.getppid() == raylet:  # reparented: the raylet ended, so do we
        time.sleep(PARENT_POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

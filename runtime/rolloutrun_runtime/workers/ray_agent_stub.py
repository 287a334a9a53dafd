"""What a worker node's raylet runs in place of Ray's two agents (see :mod:`.ray_boot`).

Why placeholders and not the agents: the raylet starts the commands it is given, waits for
the ports each agent persists in the session directory and stops when an agent ends, but a
worker node of ours needs none of what they serve, and their starts cost each refill pod
CPU on the cores the trainer uses (issue 14):

- the **dashboard agent** (dashboard, Ray metrics, log, job and profiling APIs; ~1.2 CPU-s
  for ``import ray`` and every dashboard module). Its placeholder persists the three ports
  as Ray 2.60's agent does in minimal mode with no HTTP server (``-1``: not served, so the
  node's workers export no metrics).
- the **runtime-env agent** (~0.4-0.7 CPU-s: ``import ray``, aiohttp, every runtime-env
  plugin). The raylet asks it only to set up or delete a non-empty ``runtime_env`` (a
  worker process for an empty one is started directly), and no actor of ours on a worker
  pod has one. Its placeholder binds the port Ray's agent would, persists it, and answers
  every request with HTTP 501 and a body that says why, so a ``runtime_env`` that reached a
  worker pod fails its actor by name instead of hanging. It answers nothing but that
  refusal, to anyone, so it has no token to check.

Each then lives until the raylet that started it ends.

Run as a script by the raylet (``python .../ray_agent_stub.py --stub=ROLE --node-id=...
--session-dir=... <Ray's other agent arguments>``): the standard library only, nothing of
Ray's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

#: The placeholder's roles (``--stub=``), one per Ray agent.
DASHBOARD, RUNTIME_ENV = "dashboard", "runtime-env"
#: The ports Ray's dashboard agent persists (``ray._raylet``'s ``*_PORT_NAME``; checked
#: against Ray by :func:`rolloutrun_runtime.workers.ray_boot.install`).
PORT_NAMES = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
#: The port Ray's runtime-env agent persists (checked likewise).
RUNTIME_ENV_PORT_NAME = "runtime_env_agent_port"
#: The port value of a service the agent does not run (Ray's minimal agent writes it too).
NOT_SERVED = -1
#: Seconds between two looks at whether the raylet (our parent) is still there.
PARENT_POLL_S = 1.0
#: What the runtime-env placeholder answers (HTTP 501 Not Implemented), and why.
NO_RUNTIME_ENV = (
    b"rolloutrun worker node: no runtime-env agent runs here (workers/ray_agent_stub.py); "
    b"generation actors on worker pods take no runtime_env"
)


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


def serve_refusals(host: str, port: int) -> Any:
    """An HTTP server on ``host:port`` (0: any free port) answering every request with 501
    and :data:`NO_RUNTIME_ENV` (said on stdout, the raylet's log, too), in a daemon thread;
    its bound port is ``server.server_address[1]``. Imported here: the dashboard role,
    which serves nothing, does without."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(501)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(NO_RUNTIME_ENV)))
            self.end_headers()
            self.wfile.write(NO_RUNTIME_ENV)
            print(f"ray_agent_stub: refused {self.path}: {NO_RUNTIME_ENV.decode()}", flush=True)

        do_GET = do_POST

        def log_message(self, format: str, *args: object) -> None:
            return  # do_POST says it once

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("Server", (HTTPServer,), {"address_family": family})
    server = server_class((host, port), Refuse)
    threading.Thread(target=server.serve_forever, name="refusals", daemon=True).start()
    return server


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ray_agent_stub")
    parser.add_argument("--stub", choices=[DASHBOARD, RUNTIME_ENV], default=DASHBOARD)
    parser.add_argument("--node-id", default=os.environ.get("RAY_NODE_ID"))
    parser.add_argument("--session-dir", required=True)
    parser.add_argument("--node-ip-address", default="127.0.0.1")
    parser.add_argument("--runtime-env-agent-port", type=int, default=0)
    args, _ray_arguments = parser.parse_known_args(argv)
    if not args.node_id:
        parser.error("--node-id (or $RAY_NODE_ID) is required")
    raylet = os.getppid()
    if args.stub == RUNTIME_ENV:
        server = serve_refusals(args.node_ip_address, args.runtime_env_agent_port)
        port = server.server_address[1]
        persist(args.session_dir, args.node_id, RUNTIME_ENV_PORT_NAME, int(port))
    else:
        for name in PORT_NAMES:
            persist(args.session_dir, args.node_id, name, NOT_SERVED)
    while os.getppid() == raylet:  # reparented: the raylet ended, so do we
        time.sleep(PARENT_POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

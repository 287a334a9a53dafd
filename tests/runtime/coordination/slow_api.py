"""A slow path to a real API server: a plain-HTTP front that forwards each request to the
local cluster's API server over HTTPS and can hold the requests of one method, before they
reach the server (a write that then meets a newer ``resourceVersion``) or with the server's
answer in hand (a read of the state at that moment), until the test lets them go.

Why a front and not a mock: the Lease under test talks HTTP to a real API server (TLS,
tokens, RBAC, ``resourceVersion`` conflicts) and only the timing is the test's, as an API
server slow on writes (etcd) or on reads (a loaded apiserver) would make it.
"""

from __future__ import annotations

import http.client
import http.server
import ssl
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

#: How long a call that must not wait for a held request may take (a bound on a hang only:
#: it waits for nothing held, so under any load it is answered well within this).
ANSWER_WITHIN_S = 10.0
#: Headers forwarded each way (what the Lease's client sends, what it reads back).
REQUEST_HEADERS = ("Authorization", "Accept", "Content-Type")
RESPONSE_HEADERS = ("Content-Type",)


class SlowApi:
    """``SlowApi(cluster)``: ``url`` to dial, ``hold(method, at)`` to hold requests of that
    method (``at``: ``"request"``, before the server sees them; ``"response"``, with the
    server's answer), ``arrived(method, n)`` to wait until ``n`` were held, ``release()``,
    ``seen[method]``: how many reached the server."""

    def __init__(self, cluster: Any) -> None:
        self.upstream = cluster.api_url
        self.context = ssl.create_default_context(cafile=str(cluster.ca_path))
        self.token = cluster.token
        self.seen: Counter[str] = Counter()
        self._held: dict[str, str] = {}  # method -> "request" | "response"
        self._gate = threading.Event()
        self._state = threading.Condition()
        self._waiting: Counter[str] = Counter()
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept alive, as the Lease's connections are

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                front._forward(self)

            def do_PUT(self) -> None:
                front._forward(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *_: None  # type: ignore[method-assign]  # a client gone
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig whose current context is this front, with the cluster's token."""
        config = {
            "clusters": [{"name": "slow", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": self.token}}],
            "contexts": [{"name": "slow", "context": {"cluster": "slow", "user": "u"}}],
            "current-context": "slow",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def hold(self, method: str, at: str = "request") -> None:
        with self._state:
            self._gate.clear()
            self._held[method] = at
            self._waiting[method] = 0

    def release(self) -> None:
        with self._state:
            self._held.clear()
            self._gate.set()

    def arrived(self, method: str, count: int = 1, timeout: float = 30.0) -> None:
        with self._state:
            if not self._state.wait_for(lambda: self._waiting[method] >= count, timeout):
                raise TimeoutError(f"{count} {method} requests never reached the front")

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def _wait_if(self, method: str, at: str) -> None:
        with self._state:
            if self._held.get(method) != at:
                return
            self._waiting[method] += 1
            self._state.notify_all()
        self._gate.wait()

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        method = handler.command
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        self._wait_if(method, "request")
        host, port = self.upstream.removeprefix("https://").rsplit(":", 1)
        upstream = http.client.HTTPSConnection(host, int(port), context=self.context)
        try:
            headers = {k: handler.headers[k] for k in REQUEST_HEADERS if handler.headers[k]}
            upstream.request(method, handler.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        with self._state:
            self.seen[method] += 1
        self._wait_if(method, "response")
        handler.send_response(answer.status)
        for name in RESPONSE_HEADERS:
            if answer.getheader(name):
                handler.send_header(name, answer.getheader(name) or "")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` running in a thread; its result or its exception lands in the list."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome

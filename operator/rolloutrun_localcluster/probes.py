"""Readiness probes (exec, httpGet, tcpSocket), so a pod is Ready when it can serve.

A Service's endpoints list only ready pods; a Gym server with an HTTP readiness probe joins
its Service when it answers, as on a cluster. Liveness and startup probes are not run.

Timeouts use ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for``
swallows a cancellation that arrives in the loop iteration in which the awaited connection
completes, and a probe that survives its cancellation kept its pod from ever finishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from . import netforward

logger = logging.getLogger(__name__)

Obj = dict[str, Any]


def resolve_port(port: Any, container: Obj) -> int:
    """A probe's port, by number or by the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for item in container.get("ports") or []:
        if item.get("name") == port:
            return int(item["containerPort"])
    raise ValueError(f"port {port!r} is not a number nor a named container port")


async def probe_once(
    probe: Obj,
    container: Obj,
    pod_ip: str,
    env: Mapping[str, str],
    cwd: Path,
    exec_prefix: Sequence[str] = (),
    *,
    dial: Callable[[], socket.socket] | None = None,
) -> bool:
    """Run one probe; ``True`` on success. Every error counts as a failure. An exec probe's
    command runs behind ``exec_prefix`` (entering the container's network and mount
    namespaces); ``dial`` makes the sockets that reach the pod (namespace mode, see
    :mod:`.netns`)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if dial is not None and ("httpGet" in probe or "tcpSocket" in probe):
            async with asyncio.timeout(timeout):
                return await _probe_through(probe, container, pod_ip, dial)
        if "exec" in probe:
            process = await asyncio.create_subprocess_exec(
                *exec_prefix,
                *probe["exec"].get("command", []),
                env=dict(env),
                cwd=str(cwd),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                async with asyncio.timeout(timeout):
                    return await process.wait() == 0
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
                return False
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host = spec.get("host") or pod_ip
            port = resolve_port(spec.get("port"), container)
            scheme = spec.get("scheme", "HTTP").lower()
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
            url = f"{scheme}://{host}:{port}{spec.get('path', '/')}"
            client_timeout = aiohttp.ClientTimeout(total=timeout)
            async with (
                aiohttp.ClientSession(timeout=client_timeout) as session,
                session.get(url, headers=headers) as response,
            ):
                return 200 <= response.status < 400
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            port = resolve_port(spec.get("port"), container)
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(spec.get("host") or pod_ip, port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return True
    except (OSError, TimeoutError, aiohttp.ClientError, ValueError) as error:
        logger.debug("probe failed: %s", error)
        return False
    return False


async def _probe_through(
    probe: Obj, container: Obj, pod_ip: str, dial: Callable[[], socket.socket]
) -> bool:
    """An httpGet (HTTP only) or tcpSocket probe over a socket ``dial`` creates."""
    if "httpGet" in probe:
        spec = probe["httpGet"]
        if spec.get("scheme", "HTTP").upper() != "HTTP":
            raise ValueError("HTTPS probes are not run in namespace mode")
        headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
        port = resolve_port(spec.get("port"), container)
        host = spec.get("host") or pod_ip
        status = await netforward.http_status(dial, host, port, spec.get("path", "/"), headers)
        return 200 <= status < 400
    spec = probe["tcpSocket"]
    port = resolve_port(spec.get("port"), container)
    _, writer = await netforward.open_connection(dial, spec.get("host") or pod_ip, port)
    writer.close()
    return True


class ReadinessTracker:
    """Applies ``successThreshold``/``failureThreshold`` to a stream of probe results."""

    def __init__(self, probe: Obj) -> None:
        self.success_threshold = int(probe.get("successThreshold", 1))
        self.failure_threshold = int(probe.get("failureThreshold", 3))
        self.ready = False
        self._successes = 0
        self._failures = 0

    def record(self, ok: bool) -> bool:
        """Record a result; return whether readiness changed."""
        before = self.ready
        if ok:
            self._successes += 1
            self._failures = 0
            if self._successes >= self.success_threshold:
                self.ready = True
        else:
            self._failures += 1
            self._successes = 0
            if self._failures >= self.failure_threshold:
                self.ready = False
        return before != self.ready

"""Relays between a pod's network namespace and the machine's loopback, and dialing pods.

Why: in namespace mode a pod's ``127.0.0.1`` is its own, yet pods must reach the API
server and the host services they are told about (a storage emulator) at the addresses
their environment names. A :class:`Forwarder` listens on ``127.0.0.1:<port>`` *inside* the
pod's namespace (its listening sockets are created there) and relays each connection to
``127.0.0.1:<port>`` of the machine, from the kubelet's own process. A partition pauses it:
bytes stop flowing both ways (connections hang, as through a cut link) until it resumes.

:func:`open_connection` is the other direction: a stream to a pod IP through a socket
created inside the cluster's node namespace (readiness probes, tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable

logger = logging.getLogger(__name__)

CHUNK = 65536


class Forwarder:
    """Relays ``127.0.0.1:<port>`` in one namespace to ``127.0.0.1:<port>`` of the machine."""

    def __init__(self, make_socket: Callable[[], socket.socket], ports: list[int]) -> None:
        self.make_socket = make_socket
        self.ports = ports
        self._open = asyncio.Event()
        self._open.set()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        for port in self.ports:
            sock = await asyncio.to_thread(self.make_socket)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            sock.setblocking(False)
            self._servers.append(
                await asyncio.start_server(functools.partial(self._relay, port), sock=sock)
            )

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _relay(
        self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            await self._open.wait()
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", port)
            self._writers.add(upstream)
            await asyncio.gather(self._pump(reader, upstream), self._pump(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError) as error:
            logger.debug("forwarded connection to port %d ended: %s", port, error)
        except asyncio.CancelledError:
            pass  # closed with its forwarder: the task ends quietly (asyncio asks its result)
        finally:
            self._tasks.discard(task)
            for end in (writer, upstream):
                if end is not None:
                    self._writers.discard(end)
                    end.close()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(CHUNK):
                await self._open.wait()
                sink.write(data)
                await sink.drain()
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if sink.can_write_eof():
                    sink.write_eof()


async def open_connection(
    make_socket: Callable[[], socket.socket], host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``host:port`` through a socket ``make_socket`` creates (in a namespace)."""
    sock = await asyncio.to_thread(make_socket)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def http_status(
    make_socket: Callable[[], socket.socket],
    host: str,
    port: int,
    path: str,
    headers: dict[str, str],
) -> int:
    """The status code of ``GET path`` at ``host:port`` (plain HTTP/1.0, as a probe needs)."""
    reader, writer = await open_connection(make_socket, host, port)
    try:
        lines = [f"GET {path} HTTP/1.0", f"Host: {host}:{port}", "User-Agent: kube-probe/1.32"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        status = (await reader.readline()).split()
        if len(status) < 2 or not status[1].isdigit():
            raise OSError(f"not an HTTP response: {b' '.join(status)!r}")
        return int(status[1])
    finally:
        writer.close()

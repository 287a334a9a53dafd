"""Process handling for pods: sessions, signals, and finding every process a pod started.

A container's processes die with it: each container's main process starts in a new session
(its own process group), and every process a pod starts carries the environment variable
``ROLLOUTRUN_LOCALCLUSTER_POD_UID``. Killing a pod signals its groups and then sweeps
``/proc`` for any process still carrying the tag or still in one of the pod's sessions, so a
daemon that double-forks into a new session (Ray's raylet, GCS and workers do) still dies
with the pod, as it would when a container's PID namespace goes away.

A session id outlives the session: once every process of it is gone, Linux may hand the same
number to a new process, and a new process that calls ``setsid`` (every other pod's container
does) leads a session of that number. So a pod's sessions are kept with their leader's start
time (:class:`Sessions`): a session whose number now leads a process started at another time
is somebody else's and is never signalled; and a process found only through a session while
it carries another pod's (or container's) tag is that other one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

POD_TAG = "ROLLOUTRUN_LOCALCLUSTER_POD_UID"
CONTAINER_TAG = "ROLLOUTRUN_LOCALCLUSTER_CONTAINER"
CLUSTER_TAG = "ROLLOUTRUN_LOCALCLUSTER_DIR"


async def spawn(
    argv: list[str], cwd: Path, env: dict[str, str], log_path: Path
) -> asyncio.subprocess.Process:
    """Start ``argv`` in a new session with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return await asyncio.create_subprocess_exec(
            *argv,
            cwd=str(cwd),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rsplit(b")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 else None


class Sessions:
    """The sessions a pod's containers lead, each with its leader's start time."""

    def __init__(self) -> None:
        self._leaders: dict[int, int | None] = {}

    def add(self, leader: int) -> None:
        self._leaders[leader] = start_ticks(leader)

    def __iter__(self) -> Iterator[int]:
        """The sessions still the pod's: the leader gone (Linux reuses no session number
        while a process is in it) or still the process that started then."""
        for sid, started in list(self._leaders.items()):
            now = start_ticks(sid)
            if now is None or now == started:
                yield sid
            else:  # the number leads another process now: it was reused
                del self._leaders[sid]


def _other_owner(environ: bytes, wanted: bytes) -> bool:
    """Whether ``environ`` carries ``wanted``'s name with another value (another pod's tag)."""
    name = wanted.split(b"=", 1)[0] + b"="
    return any(entry.startswith(name) and entry != wanted for entry in environ.split(b"\0"))


def tagged_pids(tag: str, sessions: Iterable[int] = ()) -> set[int]:
    """Live processes carrying the environment entry ``tag``, or in one of ``sessions`` and
    carrying no other value of the tag's name."""
    wanted = tag.encode()
    wanted_sessions = set(sessions)
    found: set[int] = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) < 4 or fields[0] == b"Z":
            continue
        environ = _read(f"/proc/{pid}/environ")
        if wanted in environ.split(b"\0") or (
            int(fields[3]) in wanted_sessions and not _other_owner(environ, wanted)
        ):
            found.add(pid)
    return found


def cluster_tag(directory: str) -> str:
    return f"{CLUSTER_TAG}={directory}"


def pod_tag(uid: str) -> str:
    return f"{POD_TAG}={uid}"


def container_tag(uid: str, name: str) -> str:
    return f"{CONTAINER_TAG}={uid}/{name}"


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_tagged(tag: str, sessions: Iterable[int]) -> int:
    """SIGKILL everything tagged ``tag`` or in ``sessions``; return how many were signalled."""
    sessions = list(sessions)
    for pgid in sessions:
        signal_group(pgid, signal.SIGKILL)
    pids = tagged_pids(tag, sessions)
    signal_pids(pids, signal.SIGKILL)
    if pids:
        logger.debug("killed %d processes tagged %s", len(pids), tag)
    return len(pids)


def freeze_tagged(tag: str, sessions: Iterable[int], frozen: bool) -> int:
    """SIGSTOP (or SIGCONT) every process tagged ``tag``: a node that stops answering."""
    sig = signal.SIGSTOP if frozen else signal.SIGCONT
    sessions = list(sessions)
    for pgid in sessions:
        signal_group(pgid, sig)
    pids = tagged_pids(tag, sessions)
    signal_pids(pids, sig)
    if frozen:
        # A process in a system call that cannot be interrupted (a container's shell joining
        # its pod's CPU cgroup, a disk write) stops only once the call returns: the freeze is
        # done when every process is stopped, not when the signals were sent.
        _until_stopped(pids, FREEZE_WAIT_S)
    return len(pids)


#: How long a freeze waits for its processes to stop before it returns anyway.
FREEZE_WAIT_S = 2.0


def _until_stopped(pids: Iterable[int], timeout: float) -> None:
    """Wait until each of ``pids`` is stopped (``T``/``t``), gone or a zombie, or ``timeout``."""
    waiting = set(pids)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        waiting = {pid for pid in waiting if _state(pid) not in (b"", b"T", b"t", b"Z", b"X")}
        if waiting:
            time.sleep(0.005)


def _state(pid: int) -> bytes:
    """A process's state letter from ``/proc/PID/stat`` (empty once it is gone)."""
    fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()
    return fields[0] if fields else b""

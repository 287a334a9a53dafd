"""A file:// storage's bulk writes and deletes done by a child process, not the trainer's.

Why: a snapshot's publication on file:// is ~100 system calls (each file's temporary file,
write, fsync, rename; each folder's fsync; retention's unlinks). Each call releases the
interpreter lock and takes it back on return, so the writer thread and the trainer's event
loop hand the lock over ~90 times a snapshot (voluntary context switches measured on the
writer thread), and the kernel's share of that work (~4.6 of ~7.9 ms of thread CPU) is
counted on a thread of the trainer. A child process that does the writes leaves the
trainer one pipe write and one read per call.

What runs where, so that every crash rule holds as before:

* the trainer checks the keys, sends the bytes (never pickled: a JSON header line, then
  the files' raw bytes, over the child's stdin) and waits for the answer; ``write_many``
  returns only once the child answered that every file and folder is fsynced;
* the child runs ``write_many`` (a snapshot's files and segments, and its manifest's bytes
  under a hidden name, all fsynced), ``write_bytes`` (LATEST), ``delete_entry`` (retention:
  the manifest, then the folder), ``delete``/``delete_prefix`` (segment collection) and
  ``modified_times`` (a ``stat`` per segment when collecting); the trainer alone makes the
  commit point, after the fence: the create-only ``link`` of the manifest's hidden file to
  its name (``LocalStorage.commit_staged``), which the child then makes durable (``settle``:
  the hidden name removed, the folder fsynced) before the call returns; a snapshot's LATEST
  and retention's deletes ride on that same call, run after the settle
  (:mod:`.after_commit`: one round trip where there were three); the trainer reads
  everything else;
* a child that dies (killed, crashed) answers nothing: the call raises
  :class:`WriterProcessError` (a ``StorageError``), so the snapshot being written is not
  published; the next call starts a new child. What it left is an uncommitted folder or
  unlisted segments, as a trainer killed mid-write leaves;
* a trainer that dies takes the child with it: the kernel's parent-death signal (armed
  first thing, and tied to the thread that started the child, which for the snapshot
  writer is the event loop's executor thread, alive until the loop ends) and end of input;
  a SIGTERM or SIGINT sent to the pod's process group does not end it (the trainer's
  preemption snapshot is written after it).

The child (``python -m rolloutrun_runtime.storage.writer_process ROOT PARENT_PID``) imports
only the storage package and runs each request on a plain :class:`~.local.LocalStorage` of
the same root, so the durability steps are the in-process ones, spelled once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.parent_death import die_with_parent

from .after_commit import AfterCommit
from .errors import (
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
)
from .local import StagedCreate

#: The errors the child answers with, raised as themselves in the trainer.
ERRORS: dict[str, type[StorageError]] = {
    cls.__name__: cls
    for cls in (
        StorageError,
        InvalidKeyError,
        ObjectExistsError,
        ObjectNotFoundError,
        StoragePermissionError,
    )
}
#: The pipe's capacity asked for, so a snapshot's bytes go in one write (Linux's default is
#: 64 KiB; an unprivileged process may raise it to /proc/sys/fs/pipe-max-size, 1 MiB).
PIPE_BYTES = 1 << 20
#: How long ``close`` waits for the child to exit once its input is closed.
EXIT_WAIT_S = 5.0
#: The most buffers one ``writev`` takes.
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))


class WriterProcessError(StorageError):
    """The writer process died or answered out of protocol: nothing of the call is known
    to be durable."""


# ---------------------------------------------------------------------- the wire (pure)
def request_parts(op: str, args: Mapping[str, Any], blobs: list[bytes]) -> list[bytes]:
    """One request as the buffers sent in order: a JSON line (``op``, ``args``, each blob's
    size), then the blobs themselves (not joined: the trainer sends them with one
    ``writev``, so a snapshot's bytes are not copied into a request first)."""
    header = {"op": op, "args": dict(args), "sizes": [len(b) for b in blobs]}
    return [json.dumps(header).encode() + b"\n", *blobs]


def error_reply(error: BaseException) -> dict[str, Any]:
    """The answer for a call that raised: a storage error by its class, URI and reason."""
    if isinstance(error, StorageError):
        name = type(error).__name__ if type(error).__name__ in ERRORS else "StorageError"
        return {"error": name, "uri": error.uri, "reason": error.reason}
    return {"error": "StorageError", "uri": "", "reason": f"{type(error).__name__}: {error}"}


def value_of(reply: Mapping[str, Any]) -> Any:
    """A reply's value, or its error raised as the class the child raised."""
    if "error" in reply:
        cls = ERRORS.get(str(reply["error"]), StorageError)
        raise cls(str(reply.get("uri", "")), str(reply.get("reason", "")))
    return reply.get("value")


# ---------------------------------------------------------------------- the trainer's side
class WriterProcess:
    """The trainer's end: one call at a time, the child started on the first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        #: Children started so far (a dead one is replaced at the next call).
        self.started = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def write_many(self, items: Mapping[str, bytes], stage: StagedCreate | None = None) -> None:
        keys = list(items)
        blobs = [bytes(items[k]) for k in keys]
        staged = None
        if stage is not None:
            staged = {"key": stage.key, "tmp": stage.tmp}
            blobs.append(bytes(stage.data))
        self._call("write_many", {"keys": keys, "stage": staged}, blobs)

    def settle(self, key: str, tmp: str, after: AfterCommit | None = None) -> None:
        """The commit's settle; then ``after`` in the same call (its outcome filled in)."""
        args, blobs = after.wire() if after is not None else (None, [])
        outcome = self._call("settle", {"key": key, "tmp": tmp, "after": args}, blobs)
        if after is not None:
            after.take(outcome)

    def write_bytes(self, key: str, data: bytes, *, durable: bool) -> None:
        self._call("write_bytes", {"key": key, "durable": durable}, [bytes(data)])

    def delete(self, key: str) -> None:
        self._call("delete", {"key": key}, [])

    def delete_entry(self, marker: str) -> int:
        return int(self._call("delete_entry", {"marker": marker}, []))

    def delete_prefix(self, prefix: str, *, durable: bool) -> int:
        return int(self._call("delete_prefix", {"prefix": prefix, "durable": durable}, []))

    def modified_times(self, prefix: str) -> dict[str, float]:
        return dict(self._call("modified_times", {"prefix": prefix}, []))

    def start(self) -> None:
        """Start the child now, if it is not running: the next call, a preemption's snapshot
        in its grace period included, then does not wait for an interpreter to start."""
        with self._lock:
            self._running()

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            _end(process)

    def _call(self, op: str, args: Mapping[str, Any], blobs: list[bytes]) -> Any:
        request = request_parts(op, args, blobs)
        with self._lock:
            process = self._running()
            assert process.stdin is not None and process.stdout is not None
            try:
                write_all(process.stdin.fileno(), request)
                crash_point("trainer_while_helper_writes")
                line = process.stdout.readline()
                reply = json.loads(line) if line else None
            except (OSError, ValueError):
                reply = None
            if not isinstance(reply, dict):
                self._process = None
                _end(process)
                raise WriterProcessError(
                    f"file://{self.root}",
                    f"the writer process (pid {process.pid}) died or answered out of "
                    f"protocol during {op} (exit code {process.returncode}); nothing of "
                    "the call is known to be durable",
                )
        return value_of(reply)

    def _running(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            command = [sys.executable, "-m", __name__, str(self.root), str(os.getpid())]
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.started += 1
            assert self._process.stdin is not None
            with contextlib.suppress(OSError, AttributeError):
                fcntl.fcntl(self._process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        return self._process


def write_all(fd: int, parts: list[bytes]) -> None:
    """Write ``parts`` in order with ``writev`` (at most ``IOV_MAX`` buffers a call), going
    on after a partial write (a pipe takes at most its capacity per call)."""
    views = [memoryview(part) for part in parts if len(part)]
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first : first + IOV_MAX])
        while written and first < len(views):
            if written >= len(views[first]):
                written -= len(views[first])
                first += 1
            else:
                views[first] = views[first][written:]
                written = 0


def _end(process: subprocess.Popen[bytes]) -> None:
    """Close the child's input (it exits at end of input); kill it if it does not."""
    for stream in (process.stdin, process.stdout):
        with contextlib.suppress(OSError):
            if stream is not None:
                stream.close()
    try:
        process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# ---------------------------------------------------------------------- the child
def _read_exact(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the trainer closed the pipe mid-request")
    return data


def serve_one(storage: Any, stream: IO[bytes], line: bytes) -> dict[str, Any]:
    """Read one request's blobs from ``stream`` and run it on ``storage`` (a LocalStorage
    without a writer); the answer to send."""
    header = json.loads(line)
    blobs = [_read_exact(stream, int(size)) for size in header["sizes"]]
    op, args = header["op"], header["args"]
    try:
        return {"value": _apply(storage, op, args, blobs)}
    except Exception as error:  # answered, then the next request
        return error_reply(error)


def _apply(storage: Any, op: str, args: Mapping[str, Any], blobs: list[bytes]) -> Any:
    """One call on the child's own LocalStorage: the in-process code, spelled once."""
    if op == "write_many":
        keys, staged = args["keys"], args.get("stage")
        stage = None
        if staged is not None:
            stage = StagedCreate(str(staged["key"]), str(staged["tmp"]), blobs.pop())
        items = dict(zip(keys, blobs, strict=True))
        after_file = lambda: crash_point("helper_mid_write")  # noqa: E731
        storage.write_many(items, after_file=after_file, stage=stage)
        return None
    if op == "settle":
        crash_point("helper_before_settle")
        storage.settle(args["key"], args["tmp"])
        if args.get("after") is None:
            return None
        after = AfterCommit.from_wire(args["after"], blobs)
        hint = lambda key, data: storage.write_bytes(key, data, durable=False)  # noqa: E731
        after.run(hint, storage.delete_entry)
        return after.outcome()
    if op == "write_bytes":
        return storage.write_bytes(args["key"], blobs[0], durable=args["durable"])
    if op == "delete":
        return storage.delete(args["key"])
    if op == "delete_entry":
        return storage.delete_entry(args["marker"])
    if op == "delete_prefix":
        return storage.delete_prefix(args["prefix"], durable=args["durable"])
    if op == "modified_times":
        return storage.modified_times(args["prefix"])
    raise StorageError(storage.base_uri, f"unknown writer call {op!r}")


def main(argv: list[str] | None = None) -> int:
    from .local import LocalStorage

    root, parent = (argv if argv is not None else sys.argv[1:])[:2]
    die_with_parent(int(parent))
    # A pod's SIGTERM reaches its whole process group (the local kubelet's killpg, a
    # terminal's SIGINT): the trainer's preemption snapshot is written through this child
    # after it, so only end of input or the trainer's death ends it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    storage = LocalStorage(Path(root))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while line := stdin.readline():
        try:
            reply = serve_one(storage, stdin, line)
        except EOFError:
            return 0
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()
    return 0  # end of input: the trainer closed the pipe or died


if __name__ == "__main__":
    raise SystemExit(main())

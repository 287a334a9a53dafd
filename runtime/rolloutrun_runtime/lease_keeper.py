"""The trainer's Kubernetes Lease held through a helper process started first thing.

Why: a trainer pod needs ``torch`` (~1.5 s of CPU to import) and its Lease held before any
side effect. A child process started first thing does the Lease's start-up work (its
interpreter, imports and credentials) on the pod's other core while the trainer imports
torch, so when the trainer asks for the Lease only the acquire's round trips remain on its
path (it asks once its configuration is read: nothing is acquired for a trainer that exits
on a configuration error). The child itself is kept cheap (~0.1 s of CPU: no ``kubernetes``
client where plain HTTPS does, see :mod:`~rolloutrun_runtime.lease_rest`), since on a
two-core pod its CPU is taken from the trainer's start-up all the same.

The child (``python -m rolloutrun_runtime.lease_keeper --parent PID``) builds the Lease the
trainer built before (the same name and identity), over plain HTTPS where the credentials
allow (:mod:`~rolloutrun_runtime.lease_rest`: it imports no ``kubernetes`` client either),
else the :class:`~rolloutrun_runtime.coordination.KubernetesLease`, and runs each call the
trainer makes on it: :class:`KeptLease` sends one JSON line per call, with an id, and the
calling thread waits for the answer with that id; the keeper answers each call on a thread
of its own. So a fence is never queued behind another call's round trip (a progress write,
a renewal, the Gym client's member-address reads): under load, with one call at a time on
the pipe and in the keeper, a fence waited up to 2.4 s behind them. In the Lease, reads take
no lock and share one GET begun after each asked
(:class:`~rolloutrun_runtime.coordination.SharedReads`), each request on a connection of its
own; writes stay compare-and-write on ``resourceVersion``, one at a time.

Fencing is exactly as strong: ``acquire`` still blocks the trainer before any side effect,
``ensure_held`` still reads the Lease from the API server before each commit (a read begun
after the fence was asked, never a cached state), renewals run in the child as they ran in a
thread. A trainer that dies takes its keeper with it (the kernel's parent-death signal, and
end of input) without a release, so the Lease expires as before; a keeper that exits while
the trainer lives is a lost Lease to the trainer (``FencedError`` to ``on_lost``, to every
call still waiting, and from every later fence), never a held one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any

from rolloutrun_runtime.contract.pod import (
    ENV_INCARNATION,
    ENV_LEASE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    holder_identity,
)
from rolloutrun_runtime.coordination import (
    FencedError,
    LeaseError,
    lease_from_environment,
    parse_time,
)
from rolloutrun_runtime.parent_death import die_with_parent

logger = logging.getLogger(__name__)

#: The errors a call may answer with, re-raised as themselves in the trainer.
ERRORS: dict[str, type[Exception]] = {
    "FencedError": FencedError,
    "LeaseError": LeaseError,
    "TimeoutError": TimeoutError,
}
#: How long ``stop`` waits for the keeper to exit once its input is closed.
EXIT_WAIT_S = 10.0


def kept_lease_from_environment(
    on_lost: Callable[[FencedError], None] | None = None,
) -> KeptLease | None:
    """In a pod (``ROLLOUTRUN_LEASE_NAME`` and ``POD_NAMESPACE`` set, where
    ``lease_from_environment`` gives a KubernetesLease): the run's Lease, held through a
    keeper process started now. Outside any cluster: None (no coordination)."""
    if os.environ.get(ENV_LEASE_NAME) and os.environ.get(ENV_POD_NAMESPACE):
        return KeptLease(on_lost=on_lost)
    return None


class KeptLease:
    """A :class:`LeaseHolder` whose calls run in a keeper process (see the module doc)."""

    def __init__(
        self,
        on_lost: Callable[[FencedError], None] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = dict(os.environ if environ is None else environ)
        # The identity the trainer would have had: its pod, else its own pid (not the child's).
        env.setdefault(ENV_POD_NAME, f"local-{os.getpid()}")
        self.incarnation = int(env.get(ENV_INCARNATION, "0") or 0)
        self.identity = holder_identity(env[ENV_POD_NAME], self.incarnation)
        self.on_lost = on_lost
        self.lost: FencedError | None = None
        self._closing = False
        self._sending = threading.Lock()  # one line at a time; never held across a round trip
        self._calls = threading.Lock()  # guards the two below
        self._waiting: dict[int, _Reply] = {}  # the calls sent and not answered, by id
        self._ended = False  # the keeper exited: no call is answered any more
        self._ids = itertools.count(1)
        command = [sys.executable, "-m", __name__, "--parent", str(os.getpid())]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self._reader = threading.Thread(target=self._read, name="lease-keeper", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ the pipe
    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            if "lost" in message:
                self._lose(FencedError(message["lost"]))
                continue
            with self._calls:
                reply = self._waiting.pop(message["id"], None)
            if reply is not None:
                reply.answer(message)
        code = self.process.wait()
        if not self._closing:
            self._lose(FencedError(f"the lease keeper exited ({code}): the lease is not renewed"))
        with self._calls:
            self._ended = True
            unanswered, self._waiting = list(self._waiting.values()), {}
        for reply in unanswered:
            reply.answer({"raise": "FencedError", "message": "the lease keeper exited"})

    def _lose(self, error: FencedError) -> None:
        if self.lost is None:
            logger.error("lease lost: %s", error)
            self.lost = error
            if self.on_lost is not None:
                self.on_lost(error)

    def _call(self, op: str, **args: Any) -> Any:
        """Send one call and wait for its answer (other threads' calls go on meanwhile)."""
        reply, number = _Reply(), next(self._ids)
        with self._calls:
            if self._ended:
                raise self.lost or FencedError("the lease keeper has exited")
            self._waiting[number] = reply
        assert self.process.stdin is not None
        try:
            with self._sending:
                self.process.stdin.write(json.dumps({"id": number, "op": op, "args": args}))
                self.process.stdin.write("\n")
                self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            with self._calls:
                self._waiting.pop(number, None)
            raise self.lost or FencedError("the lease keeper has exited") from None
        answer = reply.wait()
        if "raise" in answer:
            raise ERRORS.get(answer["raise"], RuntimeError)(answer["message"])
        return answer.get("value")

    # ------------------------------------------------------------------ LeaseHolder
    def acquire(self, timeout: float | None = None) -> None:
        self._call("acquire", timeout=timeout)
        self.lost = None
        logger.info("lease acquired (held by the keeper, pid %d)", self.process.pid)

    def renew(self) -> None:
        self._call("renew")

    def ensure_held(self) -> None:
        if self.lost is not None:
            raise self.lost
        self._call("ensure_held")

    def record_progress(
        self,
        train_step: int | None = None,
        anchor_step: int | None = None,
        latest_manifest: str | None = None,
        latest_manifest_time: dt.datetime | None = None,
        reward: float | None = None,
    ) -> None:
        self._call(
            "record_progress",
            train_step=train_step,
            anchor_step=anchor_step,
            latest_manifest=latest_manifest,
            latest_manifest_time=None
            if latest_manifest_time is None
            else latest_manifest_time.isoformat(),
            reward=reward,
        )

    def start_renewing(self, interval: float | None = None) -> None:
        self._call("start_renewing", interval=interval)

    def annotations(self, fresh: bool = False) -> Mapping[str, str]:
        return dict(self._call("annotations", fresh=fresh))

    def stop(self, release: bool = False) -> None:
        """Stop renewing (releasing the Lease if asked and still held), then end the keeper."""
        if self.process.poll() is None:
            with contextlib.suppress(FencedError):
                self._call("stop", release=release)
        self.close()

    def close(self) -> None:
        """End the keeper without a release (a keeper that never acquired, or after stop)."""
        self._closing = True
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Reply:
    """The answer one call waits for, put there by the reader thread."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._message: dict[str, Any] = {}

    def answer(self, message: dict[str, Any]) -> None:
        self._message = message
        self._ready.set()

    def wait(self) -> dict[str, Any]:
        self._ready.wait()
        return self._message


# ---------------------------------------------------------------------- the keeper
def _apply(lease: Any, op: str, args: dict[str, Any]) -> Any:
    """One call of the trainer on the real lease; the value to answer with."""
    if op == "record_progress":
        args = {**args, "latest_manifest_time": parse_time(args.get("latest_manifest_time"))}
    if op == "annotations":
        return dict(lease.annotations(**args))
    if op not in {"acquire", "renew", "ensure_held", "record_progress", "start_renewing", "stop"}:
        raise RuntimeError(f"unknown lease call {op!r}")
    getattr(lease, op)(**args)
    return None


def keeper_lease(on_lost: Callable[[FencedError], None]) -> Any:
    """The run's Lease the keeper holds: over plain HTTPS (:mod:`~rolloutrun_runtime.lease_rest`,
    ~0.55 s less CPU than importing the ``kubernetes`` client beside the trainer's torch
    import), or, where the credentials need the client (an ``exec`` plugin, several
    kubeconfig files), the client's KubernetesLease. The same name, identity and semantics."""
    from rolloutrun_runtime.lease_rest import rest_lease_from_environment

    lease = rest_lease_from_environment(on_lost=on_lost)
    if lease is None:
        logger.info("credentials need the kubernetes client: KubernetesLease")
        return lease_from_environment(on_lost=on_lost)
    logger.info("the Lease over plain HTTPS at %s", lease.access.server)
    return lease


def serve(lease_in: IO[str], lease_out: IO[str]) -> None:
    """Answer the trainer's calls, each on a thread of its own (so a fence never waits for
    another call's round trip), until its end of the pipe closes; then return at once,
    without a release (a trainer that closed after ``stop`` had it released there) and
    without waiting for calls still in flight (nobody waits for their answers)."""
    writing = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with writing:
            lease_out.write(json.dumps(message) + "\n")
            lease_out.flush()

    lease = keeper_lease(on_lost=lambda error: send({"lost": str(error)}))
    if lease is None:
        raise SystemExit("lease keeper: no Lease in the environment")

    def answer(request: dict[str, Any]) -> None:
        number = request["id"]
        try:
            send({"id": number, "value": _apply(lease, request["op"], request["args"])})
        except Exception as error:  # answered; the trainer raises it as itself
            send({"id": number, "raise": type(error).__name__, "message": str(error)})

    for line in lease_in:
        request = json.loads(line)
        name = f"lease-call-{request['op']}"
        threading.Thread(target=answer, args=(request,), name=name, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    # A preemption notice is the trainer's: its forced snapshot needs the Lease, so the
    # keeper ends only with its trainer (end of input, or the parent-death signal).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(args.parent)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print cannot break the pipe
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lease-keeper %(message)s")
    serve(sys.stdin, answers)
    os._exit(0)  # no release, no waiting for the renewal thread


if __name__ == "__main__":
    raise SystemExit(main())

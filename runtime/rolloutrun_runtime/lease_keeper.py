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
else the :class:`~rolloutrun_runtime.coordination.KubernetesLease`, and runs
each call the trainer makes on it: :class:`KeptLease` sends one JSON line per call and waits
for its answer. Fencing is exactly as strong: ``acquire`` still blocks the trainer before any
side effect, ``ensure_held`` still reads the Lease from the API server before each commit,
renewals run in the child as they ran in a thread. A trainer that dies takes its keeper with
it (the kernel's parent-death signal, and end of input) without a release, so the Lease
expires as before; a keeper that exits while the trainer lives is a lost Lease to the trainer
(``FencedError`` to ``on_lost``, and from every later fence), never a held one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import queue
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
        self._calls = threading.Lock()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
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
            else:
                self._replies.put(message)
        code = self.process.wait()
        if not self._closing:
            self._lose(FencedError(f"the lease keeper exited ({code}): the lease is not renewed"))
        self._replies.put({"raise": "FencedError", "message": "the lease keeper exited"})

    def _lose(self, error: FencedError) -> None:
        if self.lost is None:
            logger.error("lease lost: %s", error)
            self.lost = error
            if self.on_lost is not None:
                self.on_lost(error)

    def _call(self, op: str, **args: Any) -> Any:
        with self._calls:
            if self.process.poll() is not None:
                raise self.lost or FencedError("the lease keeper has exited")
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise self.lost or FencedError("the lease keeper has exited") from None
            reply = self._replies.get()
        if "raise" in reply:
            raise ERRORS.get(reply["raise"], RuntimeError)(reply["message"])
        return reply.get("value")

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
    """Answer the trainer's calls until its end of the pipe closes; then exit at once,
    without a release (a trainer that closed after ``stop`` had it released there)."""
    writing = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        with writing:
            lease_out.write(json.dumps(message) + "\n")
            lease_out.flush()

    lease = keeper_lease(on_lost=lambda error: send({"lost": str(error)}))
    if lease is None:
        raise SystemExit("lease keeper: no Lease in the environment")
    for line in lease_in:
        request = json.loads(line)
        try:
            send({"value": _apply(lease, request["op"], request["args"])})
        except Exception as error:  # answered; the trainer raises it as itself
            send({"raise": type(error).__name__, "message": str(error)})


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

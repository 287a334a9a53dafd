"""What the trainer and the Gym need from their pod: the config file, where to listen, the
lease wired into the run.

Why a module of its own: these are the pod contract's runtime half (its names are spelled
in :mod:`rolloutrun_runtime.contract.pod`, which the operator's builders write), the same
for every entry point, and the controller never needs them; ``rolloutrun train`` (no pod)
passes through every function here unchanged.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.contract.pod import (
    ENV_GENERATION_PORT,
    ENV_GYM_TOKEN,
    ENV_LOCALCLUSTER_ROOT,
    ENV_METRICS_TOKEN,
    ENV_POD_IP,
    MemberEndpoint,
    Role,
    member_endpoints_annotation,
    parse_member_endpoints,
)

if TYPE_CHECKING:
    from rolloutrun_runtime.coordination import LeaseHolder

logger = logging.getLogger(__name__)

#: Exit code of a trainer that lost its lease (another incarnation took it, or it expired).
EXIT_FENCED = 3


def resolve_config_path(path: str, environ: Mapping[str, str] | None = None) -> str:
    """The config file as given, or inside the local cluster's pod root.

    The local cluster's loopback mode has no mount namespaces: a ConfigMap mounted at
    ``/etc/rolloutrun`` is a directory linked at
    ``$ROLLOUTRUN_LOCALCLUSTER_ROOT/etc/rolloutrun``. An absolute path that does not exist
    is looked up there, so the pod command is the same on both clusters (in namespace mode
    the variable is unset and the path exists).
    """
    env = os.environ if environ is None else environ
    root = env.get(ENV_LOCALCLUSTER_ROOT)
    if root and os.path.isabs(path) and not os.path.exists(path):
        inside = os.path.join(root, path.lstrip("/"))
        if os.path.exists(inside):
            return inside
    return path


def take_gym_token() -> str | None:
    """The Gym token (:data:`ENV_GYM_TOKEN`), removed from this process's environment.

    Why: every child process inherits the environment (a tool a Gym task runs, a worker the
    trainer starts), and none of them may drive the Gym's control plane. The entry points
    call this once at startup and hand the token on as an argument; later calls get None.
    """
    return os.environ.pop(ENV_GYM_TOKEN, None) or None


def take_metrics_token() -> str | None:
    """The metrics token (:data:`ENV_METRICS_TOKEN`), removed from the environment as
    :func:`take_gym_token` removes the Gym token (no child process inherits it)."""
    return os.environ.pop(ENV_METRICS_TOKEN, None) or None


def generation_address(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Where the generation servers listen: ``$POD_IP`` and the pod's generation port in a
    pod (the Gym pods call the URL the trainer sends in each ``/run``), else 127.0.0.1 on a
    free port."""
    env = os.environ if environ is None else environ
    host = env.get(ENV_POD_IP) or "127.0.0.1"
    port = int(env.get(ENV_GENERATION_PORT) or 0) if env.get(ENV_POD_IP) else 0
    return host, port


class PodLease:
    """The trainer's lease wired into the run: fencing, progress annotations, loss.

    Progress is written from one worker thread (in order, off the event loop), coalesced:
    values recorded while a write is queued join it (only the newest of each matters), so a
    slow API server gets one write per round trip, not one per step. A lost lease (taken by
    a newer incarnation, or expired) cancels the run: a fenced trainer stops.
    """

    def __init__(self, lease: LeaseHolder | None = None) -> None:
        self.lease = lease
        self.lost_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[Any] | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: dict[str, Any] = {}  # progress not yet taken by a write
        self._pending_lock = threading.Lock()
        self._anchor = -1  # the newest durable step_<N> recorded (anchors only move forward)

    def attach(self, loop: asyncio.AbstractEventLoop, task: asyncio.Future[Any]) -> None:
        self._loop, self._task = loop, task

    def lost(self, error: BaseException) -> None:
        """The renewal thread found the lease lost: stop the run (called off the loop)."""
        self.lost_error = error
        if self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)

    def fence(self) -> None:
        """Raise FencedError unless this trainer still holds its lease (before a commit)."""
        if self.lease is not None:
            self.lease.ensure_held()

    def _record(self, **progress: Any) -> None:
        if self.lease is None:
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="lease-progress")
        with self._pending_lock:
            queued = bool(self._pending)  # a write not yet started will take these too
            self._pending = coalesce(self._pending, progress)
            start = not queued and bool(self._pending)
        if start:
            self._writer.submit(self._write)

    def _write(self) -> None:
        assert self.lease is not None
        with self._pending_lock:
            progress, self._pending = self._pending, {}
        try:
            self.lease.record_progress(**progress)
        except Exception as error:  # a missed annotation is retried by the next one
            logger.warning("recording progress on the lease failed: %s", error)

    def on_step(self, step: dict[str, Any]) -> None:
        reward = step.get("reward_mean")
        reward = float(reward) if isinstance(reward, int | float) else None
        self._record(train_step=int(step["step"]), reward=reward)

    def on_anchor(self, step: int) -> None:
        self._anchor = max(self._anchor, step)
        self._record(anchor_step=self._anchor)

    def on_published(self, published: dict[str, Any]) -> None:
        when = published.get("published_at")
        if isinstance(when, int | float):
            when = dt.datetime.fromtimestamp(when, dt.UTC)
        elif isinstance(when, str):
            when = dt.datetime.fromisoformat(when.replace("Z", "+00:00"))
        # Not the snapshot's train step: that is the one its cut captured, older than the
        # step on_step already recorded.
        anchor = published.get("anchor_step")
        if isinstance(anchor, int):
            self._anchor = max(self._anchor, anchor)
        self._record(
            anchor_step=self._anchor if self._anchor >= 0 else None,
            latest_manifest=published.get("manifest_uri"),
            latest_manifest_time=when,
        )

    def gym_members(self, fresh: bool) -> dict[int, MemberEndpoint]:
        """Where replaced Gym replicas serve (the operator writes it on the Lease): for the
        Gym client's re-admission (elastic members). Nothing without a lease."""
        if self.lease is None:
            return {}
        notes = self.lease.annotations(fresh)
        text = notes.get(member_endpoints_annotation(Role.GYM))
        return parse_member_endpoints(text, getattr(self.lease, "incarnation", -1))

    def close(self) -> None:
        """Wait for the progress still queued (at most a few small writes)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None


def coalesce(queued: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, Any]:
    """Progress not yet written, with ``newer`` values recorded over it (None: unchanged).
    A newer manifest replaces the queued manifest's time as well, even with none of its own
    (the write then stamps it), so a manifest is never written with another's time."""
    merged = dict(queued)
    if newer.get("latest_manifest") is not None:
        merged.pop("latest_manifest_time", None)
    merged.update({key: value for key, value in newer.items() if value is not None})
    return merged


def fenced_checkpointer(
    storage: Any,
    keep_latest: int,
    fence: Callable[[], None] | None,
    on_anchor: Callable[[int], None] | None,
) -> Any:
    """A TrainerCheckpointer that asks ``fence`` at each commit point and reports anchors."""
    from rolloutrun_runtime.algorithms.trainer_checkpoint import TrainerCheckpointer

    class PodCheckpointer(TrainerCheckpointer):
        def publish_files(self, step: int, files: Mapping[str, bytes]) -> str:
            # The fence runs right before the marker: a trainer whose lease was taken over
            # while it uploaded never commits (fencing).
            uri = super().publish_files(step, files)
            if on_anchor is not None:
                on_anchor(step)
            return uri

    return PodCheckpointer(storage, keep_latest, fence=fence)

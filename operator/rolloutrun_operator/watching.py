"""What the operator keeps in memory per run between passes, and which watch events wake one.

Why: a full pass costs about ten API requests (the run, its static children, nodes, the
status patch). A trainer renews its Lease every ``duration/3`` seconds; waking a full pass
for each renewal made the API load grow with every renewal. Here a renewal only moves the
expiry deadline (judged on the operator's clock, as ``status.lease`` does). Progress
annotations are mirrored into status by one small patch: a new snapshot manifest or anchor
step at once, the train step alone at most once per :data:`PROGRESS_MIRROR_SECONDS`. A pass
runs on a change of the run, of a member pod, of the Lease's holder, or when a deadline is
due. The pods come from Kopf indexes, the Lease from the operator's own watch
(:mod:`.lease_watch`), trusted once they show what the last
pass created and deleted and nothing older than it saw (else the pass reads them from the
API: an index may lag behind the operator's own writes).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_operator import naming
from rolloutrun_operator.api.v1alpha1 import LeaseObservation, RolloutRunStatus
from rolloutrun_operator.losses import LEASE_EXPIRY_MARGIN_SECONDS
from rolloutrun_operator.observe import format_time, lease_view
from rolloutrun_operator.plan import Action, Verb
from rolloutrun_operator.progress import step_rate

#: Shortest time between two mirrors of a run's train step alone (a new anchor step or
#: snapshot manifest is mirrored at once, with the train step).
PROGRESS_MIRROR_SECONDS = 120.0

#: The status fields (JSON names) the Lease's progress annotations are mirrored into, and
#: those that change every step (mirrored at most once per :data:`PROGRESS_MIRROR_SECONDS`).
PROGRESS_FIELDS = (
    "trainStep",
    "anchorStep",
    "latestManifestUri",
    "latestManifestTime",
    "lastReward",
)
EVERY_STEP_FIELDS = frozenset({"trainStep", "lastReward"})
#: The step-rate fields a mirror moves along with the train step (see :mod:`.progress`).
RATE_FIELDS = ("stepRate", "stepWindow")

Json = Mapping[str, Any]

#: The kinds of a run's static children the operator watches (label-selected, like its pods
#: and Lease) so that one deleted by hand is recreated within seconds, not at the resync.
#: Secrets are not among them: watching them would need ``list``/``watch`` on every Secret
#: of the namespace, a right the operator does without (a deleted token Secret comes back
#: at the resync, see docs/operations.md); the Lease has its own watch.
WATCHED_CHILD_KINDS = (
    "ConfigMap",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
)

#: The kinds whose children a pass reads from the Kopf indexes of those watches (the pods
#: and the Lease have their own), not with a GET each.
INDEXED_CHILD_KINDS = frozenset(WATCHED_CHILD_KINDS)

#: How long a child of a kind no index holds (the Secrets, a ServiceAccount the spec names)
#: that a pass found present is taken as present by the passes after it without a GET: a
#: lost pod's reaction is two passes a fraction of a second apart (delete the old members,
#: then start the next incarnation), and the second read them again on the replacement's
#: path. Longer than that pair, far shorter than the resync at which a deleted token Secret
#: comes back anyway (no watch wakes a pass for one).
RECENT_READ_SECONDS = 30.0

#: How long a pass waits for the watch indexes to show what the last pass did (and nothing
#: older than it saw) before it reads everything from the API instead: a lost pod's passes
#: met an index one event behind (the other Gym's deletion, the Lease's last renewal) and
#: sent a dozen reads, each slower than the event they stood in for on a loaded API server.
INDEX_WAIT_SECONDS = 1.0
INDEX_POLL_SECONDS = 0.02


def child_event_needs_pass(event_type: str | None, run_known: bool) -> bool:
    """Whether an event of a labelled static child makes its run's pass due: its deletion
    (or its leaving the run's label selection, which a watch reports the same way), for a
    run whose daemon is running. Its creation (the operator's own, or the initial listing)
    asks for nothing, so the watch adds no pass; a run not known is being deleted (its
    children go with it) or not started yet (its first pass creates them)."""
    return event_type == "DELETED" and run_known


def run_signature(body: Json) -> tuple[Any, ...]:
    """What of the run a pass reacts to: its generation (spec), deletion, labels and the
    annotations that are not Kopf's. The operator's own status patches leave it unchanged,
    so they do not wake another pass."""
    meta = body.get("metadata") or {}
    notes = meta.get("annotations") or {}
    own = {k: v for k, v in notes.items() if not k.startswith(naming.KOPF_ANNOTATION_PREFIX)}
    return (
        meta.get("generation"),
        meta.get("deletionTimestamp"),
        tuple(sorted((meta.get("labels") or {}).items())),
        tuple(sorted(own.items())),
    )


def lease_progress(body: Json) -> dict[str, Any]:
    """The status fields the Lease's progress annotations stand for, read as a pass reads
    them (:func:`~rolloutrun_operator.observe.lease_view`: a time the CRD would refuse or a
    reward past its bound is dropped), so a mirror writes what ``_mirror_lease`` would."""
    lease = lease_view(body)
    progress: dict[str, Any] = {
        "trainStep": lease.train_step,
        "anchorStep": lease.anchor_step,
        "lastReward": lease.reward,
    }
    if lease.latest_manifest:
        progress["latestManifestUri"] = lease.latest_manifest
        progress["latestManifestTime"] = lease.latest_manifest_time
    return {key: value for key, value in progress.items() if value is not None}


def rate_after(mirrored: Json, train_step: int | None, now: dt.datetime) -> dict[str, Any]:
    """``stepRate`` and ``stepWindow`` once the train step is ``train_step``, from the ones
    last written (``mirrored``), as a pass computes them (:func:`.progress.step_rate`): a
    mirror moves the rate along with the step, so it is no staler than the step."""
    if train_step is None:
        return {}
    status = RolloutRunStatus(
        train_step=train_step,
        step_rate=mirrored.get("stepRate"),
        step_window=mirrored.get("stepWindow"),
    )
    step_rate(status, True, now)
    return {"stepRate": status.step_rate, "stepWindow": status.step_window}


@dataclass
class LeaseSeen:
    """The Lease's holder and ``renewTime`` as last seen, and when (operator clock)."""

    holder: str
    renew_time: str
    observed_at: dt.datetime
    duration_seconds: int | None

    def deadline(self) -> dt.datetime | None:
        if self.duration_seconds is None:
            return None
        margin = self.duration_seconds + LEASE_EXPIRY_MARGIN_SECONDS
        return self.observed_at + dt.timedelta(seconds=margin)

    def observation(self) -> LeaseObservation:
        return LeaseObservation(
            holder=self.holder,
            renew_time=self.renew_time,
            observed_at=format_time(self.observed_at),
        )


def lease_seen(body: Json, now: dt.datetime) -> LeaseSeen:
    spec = body.get("spec") or {}
    renewed = str(spec.get("renewTime") or spec.get("acquireTime") or "")
    duration = spec.get("leaseDurationSeconds")
    return LeaseSeen(
        holder=str(spec.get("holderIdentity") or "")[:253],
        renew_time=renewed[:64],
        observed_at=now,
        duration_seconds=int(duration) if isinstance(duration, int) else None,
    )


@dataclass
class RunMemory:
    """One run's in-memory state, touched only on the operator's event loop."""

    signature: tuple[Any, ...] | None = None
    dirty: bool = True
    """A pass is needed (a change of the run, a member pod or the Lease's holder)."""
    passes: int = 0
    busy: bool = False
    """A pass is under way."""
    due_since: float | None = None
    """Wall-clock time (``time.time()``) a watch event first made a pass due since the last
    pass began (None: none did): logged with each pass that acts, so a slow reaction can be
    split into event seen -> pass began -> pass done (see :func:`pass_timing`)."""
    lease: LeaseSeen | None = None
    run_body: dict[str, Any] | None = None
    """The run as its last watch event showed it (Kopf's own ``body`` of a daemon is not
    kept current)."""
    run_version: str | None = None
    """The run's ``resourceVersion`` after this operator's last status write (None: not
    known, e.g. a write that failed and may or may not have happened)."""
    progress: dict[str, Any] = field(default_factory=dict)
    mirrored: dict[str, Any] = field(default_factory=dict)
    """Progress as last written into status."""
    mirrored_at: float = float("-inf")
    """Monotonic time of the last progress write."""
    seen: dict[tuple[str, str], str] = field(default_factory=dict)
    """``resourceVersion`` of each pod and Lease the last pass saw: Kopf handles each
    object's events on its own, so an index can hold one pod newer and another older than a
    pass saw; a pass never decides on a view older than the last one."""
    created: set[tuple[str, str]] = field(default_factory=set)
    deleted: set[tuple[str, str, str | None]] = field(default_factory=set)
    replaced: set[tuple[str, str]] = field(default_factory=set)
    """Children the last pass replaced: the indexes must show a version newer than it saw."""
    gone: set[tuple[str, str]] = field(default_factory=set)
    """``(kind, name)`` of the pods, Lease and indexed children whose deletion a watch
    event reported (none re-added since): one the last pass saw is missing from its index
    because it is gone, not because the index lags (a lost pod's passes read the API
    otherwise, on the replacement's path)."""
    failures: int = 0
    """Failed passes in a row."""
    retry_in: float | None = None
    """The delay chosen after the last failed pass (seconds)."""
    read: dict[str, tuple[float, Any]] = field(default_factory=dict)
    """``Kind/name`` of each child of a kind no index holds that a pass found present, to
    the monotonic time it was read and the object (see :data:`RECENT_READ_SECONDS`)."""

    def make_due(self, at: float) -> None:
        """A watch event asks for a pass (at wall-clock ``at``)."""
        self.dirty = True
        if self.due_since is None:
            self.due_since = at

    def watched_run(self) -> dict[str, Any] | None:
        """The run as its last watch event showed it (:attr:`run_body`), for a pass to start
        from instead of a GET, when it is known to show this operator's last status write
        (a pass must never decide on an older status: it would count incarnations again);
        else None."""
        body, version = self.run_body, self.run_version
        if body is None or version is None or older(_version(body), version):
            return None
        return body

    def wrote_run(self, written: Json | None) -> None:
        """The run as this operator's status write returned it: the body the next pass
        starts from (no GET on a lost pod's second pass, whose first pass wrote status)
        until a watch event shows a version not older (:attr:`run_body`)."""
        if written is None:
            return
        if self.run_body is None or older(_version(self.run_body), _version(written)):
            self.run_body = dict(written)

    def saw_run(self, body: Json) -> bool:
        """Record a run event; True when it asks for a pass."""
        signature = run_signature(body)
        if signature != self.signature:
            self.signature = signature
            self.dirty = True
        return self.dirty

    def saw_lease(self, body: Json, now: dt.datetime, deleted: bool = False) -> bool:
        """Record a Lease event; True when it asks for a pass (a new holder, a duration
        change, the Lease gone); a renewal only moves the deadline."""
        if deleted:
            self.lease = None
            self.dirty = True
            return True
        seen = lease_seen(body, now)
        self.progress = lease_progress(body)
        before = self.lease
        if before is None or (before.holder, before.duration_seconds) != (
            seen.holder,
            seen.duration_seconds,
        ):
            self.lease = seen
            self.dirty = True
            return True
        if before.renew_time != seen.renew_time:
            self.lease = seen
        return False

    def progress_due(self, monotonic: float) -> float | None:
        """Seconds until the pending progress may be mirrored (0: now); None: nothing new."""
        changed = {k for k, v in self.progress.items() if self.mirrored.get(k) != v}
        if not changed:
            return None
        if changed - EVERY_STEP_FIELDS:
            return 0.0  # a new anchor or snapshot manifest: at once (rare, and users wait on it)
        if any(self.mirrored.get(key) is None for key in changed):
            return 0.0  # the first step or reward an incarnation reports: users wait on it too
        return max(self.mirrored_at + PROGRESS_MIRROR_SECONDS - monotonic, 0.0)

    def mirrored_progress(self, status: Json, monotonic: float) -> None:
        fields = (*PROGRESS_FIELDS, *RATE_FIELDS)
        self.mirrored = {k: status.get(k) for k in fields if k in status}
        self.mirrored_at = monotonic

    def expect(self, actions: Iterable[Action]) -> None:
        """Remember the pods and Lease the pass created or deleted: until the indexes show
        them, the next pass reads the API instead; an unindexed child acted on is read again."""
        for action in actions:
            self.read.pop(f"{action.kind}/{action.name}", None)
            if action.kind not in ("Pod", "Lease") and action.kind not in INDEXED_CHILD_KINDS:
                continue
            if action.verb is Verb.CREATE:
                self.created.add((action.kind, action.name))
            elif action.verb is Verb.DELETE:
                self.deleted.add((action.kind, action.name, action.uid))
            elif action.verb is Verb.REPLACE:
                self.replaced.add((action.kind, action.name))

    def indexes_current(
        self, pods: Iterable[Json], lease: Json | None, children: Mapping[str, Json] | None = None
    ) -> bool:
        """Whether the indexed ``pods``, ``lease`` and static ``children`` show every
        expected create, replace and delete; clears the expectations when they do."""
        found = {("Pod", _name(pod)): pod for pod in pods}
        for ref, child in (children or {}).items():
            kind, _, name = ref.partition("/")
            found[(kind, name)] = child
        if lease is not None:
            found[("Lease", _name(lease))] = lease
        for key, version in self.seen.items():
            obj = found.get(key)
            if obj is None and key in self.gone:
                continue  # its deletion was watched: newer than anything a pass saw
            if obj is None or older(_version(obj), version):
                return False
            if key in self.replaced and _version(obj) == version:
                return False
        for key in self.created | self.replaced:
            if key not in found:
                return False
        for kind, name, uid in self.deleted:
            obj = found.get((kind, name))
            if obj is None:
                continue
            meta = obj.get("metadata") or {}
            if meta.get("deletionTimestamp") or (uid and meta.get("uid") != uid):
                continue
            return False
        self.forget_expectations()
        return True

    def saw(
        self,
        pods: Iterable[Json],
        lease: Json | None,
        children: Mapping[str, Json | None] | None = None,
    ) -> None:
        """Record what a pass decided on (see :attr:`seen`); ``children``: the static
        children of the indexed kinds, ``Kind/name`` to the object (None: absent)."""
        self.seen = {("Pod", _name(pod)): _version(pod) for pod in pods}
        for ref, child in (children or {}).items():
            kind, _, name = ref.partition("/")
            if kind not in INDEXED_CHILD_KINDS:
                self.read_now(ref, child)
            elif child is not None:
                self.seen[(kind, name)] = _version(child)
        if lease is not None:
            self.seen[("Lease", _name(lease))] = _version(lease)
        self.gone &= set(self.seen)  # only what a pass saw is looked for in its index

    def current_children(
        self, children: Mapping[str, dict[str, Any]] | None
    ) -> dict[str, dict[str, Any]] | None:
        """Of the indexed static ``children``, those a pass may trust while the pods lag
        behind: none the last pass created, replaced or deleted, none older than it saw."""
        if children is None:
            return None
        pending = self.created | self.replaced | {(k, n) for k, n, _ in self.deleted}
        current = {}
        for ref, child in children.items():
            kind, _, name = ref.partition("/")
            seen = self.seen.get((kind, name))
            if (kind, name) in pending or (seen is not None and older(_version(child), seen)):
                continue
            current[ref] = child
        return current

    def watched(self, kind: str, name: str, deleted: bool) -> None:
        """A watch event of the run's ``kind/name`` (see :attr:`gone`)."""
        if deleted:
            self.gone.add((kind, name))
        else:
            self.gone.discard((kind, name))

    def read_now(self, ref: str, child: Any) -> None:
        """A pass read the unindexed child ``ref`` (None: absent, not remembered)."""
        if child is None:
            self.read.pop(ref, None)
        else:
            self.read[ref] = (time.monotonic(), child)

    def recent_reads(self, monotonic: float) -> dict[str, Any]:
        """The unindexed children a pass found present less than :data:`RECENT_READ_SECONDS`
        ago (none acted on since: :meth:`expect` forgets those)."""
        return {
            ref: child
            for ref, (at, child) in self.read.items()
            if monotonic - at < RECENT_READ_SECONDS
        }

    def forget_expectations(self) -> None:
        self.created.clear()
        self.deleted.clear()
        self.replaced.clear()

    def lease_for_pass(
        self, lease: Json | None, recorded: LeaseObservation | None
    ) -> LeaseObservation | None:
        """The ``status.lease`` a pass should start from: the renewal this operator saw
        arrive (its own clock) when the Lease still shows it and ``status.lease`` records an
        older one; else what status records (a restarted operator keeps counting)."""
        if lease is None or self.lease is None:
            return recorded
        current = lease_seen(lease, self.lease.observed_at)
        if (current.holder, current.renew_time) != (self.lease.holder, self.lease.renew_time):
            return recorded
        if recorded is not None and (recorded.holder, recorded.renew_time) == (
            current.holder,
            current.renew_time,
        ):
            return recorded
        return self.lease.observation()


async def index_catch_up(
    memory: RunMemory, stopped: Any, current: Callable[[], Any], bound: float | None = None
) -> bool:
    """Wait (up to ``bound`` seconds, default :data:`INDEX_WAIT_SECONDS`, looking every
    :data:`INDEX_POLL_SECONDS`) until the indexes ``current()`` returns (its ``pods``,
    ``lease`` and ``children``) show what the last pass did; True when they do. In-memory
    checks only: a renewal or an index event wakes nothing, so it looks rather than waits."""
    deadline = time.monotonic() + (INDEX_WAIT_SECONDS if bound is None else bound)
    while not stopped:
        known = current()
        if memory.indexes_current(known.pods, known.lease, known.children):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(INDEX_POLL_SECONDS)
    return False


def expiry_wait(
    memory: RunMemory, pass_expiry: dt.datetime | None, pass_renew: str | None, now: dt.datetime
) -> float:
    """Seconds until the Lease's expiry is due (inf: the pass found no Lease to time): the
    pass's own expiry, moved later by a renewal seen since (``renewTime`` no longer the
    ``pass_renew`` the pass judged)."""
    if pass_expiry is None:
        return float("inf")
    due = pass_expiry
    if memory.lease is not None and memory.lease.renew_time != pass_renew:
        later = memory.lease.deadline()
        if later is not None and later > due:
            due = later
    return (due - now).total_seconds()


def idle_step(dirty: bool, other_wait: float, expiry: float, progress: float | None) -> float:
    """What an idle daemon does next, from the seconds until each deadline: ``0.0`` run a
    pass now; ``-1.0`` mirror the Lease's progress (no pass), then look again; else wait
    that long (a wake-up ends the wait early). A pass asked for by a watch event (``dirty``:
    a member pod lost, a static child deleted, the run changed) runs at once, whatever the
    renewal clock says: renewals move only the expiry, never hold a pass back."""
    if dirty or min(other_wait, expiry) <= 0:
        return 0.0
    if progress is not None and progress <= 0:
        return -1.0
    return min(other_wait, expiry, progress if progress is not None else float("inf"))


def pass_timing(
    due_since: float | None,
    queued: float,
    began: float,
    done: float,
    actions: int,
    reads: Iterable[tuple[str, float]] = (),
) -> str:
    """One line on a pass that acted: when an event made it due (wall clock, to compare with
    the API server's commits), how long it then waited for a pass slot, how long it took
    (``queued``, ``began``, ``done``: wall-clock times the pass asked for a slot, got one
    and ended), and each read it made with its seconds (``reads``, as the API answered
    them; those sent together overlap), so a slow pass says which read was slow."""
    due = "due by a deadline"
    if due_since is not None:
        due = f"due at {due_since:.3f} ({queued - due_since:.3f} s before it queued)"
    listed = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in reads) or "none"
    return (
        f"{actions} action(s) in {done - began:.3f} s; {due}; "
        f"{began - queued:.3f} s waiting for a pass slot; reads: {listed}"
    )


def older(version: str, than: str) -> bool:
    """Whether ``version`` precedes ``than`` (resourceVersions are opaque, but etcd's and
    the local cluster's are increasing integers; other values only compare equal)."""
    if version.isdigit() and than.isdigit():
        return int(version) < int(than)
    return version != than


def _version(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _name(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


#: The handlers Kopf runs on every watch event (a pod's status, a Lease's renewal, a run's
#: status write): Kopf logs "Handler '...' succeeded." at INFO for each, tens of lines a
#: second at a thousand runs; :class:`QuietEventHandlers` moves those lines to DEBUG.
EVENT_HANDLERS = frozenset(
    {
        "run_changed",
        "member_changed",
        "workload_changed",
        *(f"child_deleted/{kind}" for kind in WATCHED_CHILD_KINDS),
    }
)


class QuietEventHandlers(logging.Filter):
    """On Kopf's ``kopf.objects`` logger: the success line of an :data:`EVENT_HANDLERS`
    handler becomes a DEBUG record (shown with ``--verbose``/DEBUG handlers only); every
    other line, failures of those handlers included, is left as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and _handler_success(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _handler_success(message: str) -> bool:
    prefix, suffix = "Handler '", "' succeeded."
    if not (message.startswith(prefix) and message.endswith(suffix)):
        return False
    return message[len(prefix) : -len(suffix)] in EVENT_HANDLERS


def quiet_event_handlers(logger: logging.Logger) -> None:
    """Install :class:`QuietEventHandlers` on ``logger`` once."""
    if not any(isinstance(each, QuietEventHandlers) for each in logger.filters):
        logger.addFilter(QuietEventHandlers())

"""The pod garbage collector's rules for pods no kubelet will ever end: those bound to a Node
that no longer exists, and those deleted before they were scheduled.

Why: a Node object deleted (``kubectl delete node``, or a cloud's node controller removing a
preempted VM) takes its kubelet's reports with it, so its pods would read ``Running`` for
ever; and a pod deleted while ``Pending`` that a finalizer holds has no kubelet to write its
end. On a real cluster kube-controller-manager's PodGC (``pkg/controller/podgc``) ends both,
every ``gcCheckPeriod`` (20 s): a pod whose node is missing is collected once that node has
stayed missing for the quarantine (40 s: a node re-registering meanwhile keeps its pods),
marked ``Failed`` with ``DisruptionTarget=True`` (``DeletionByPodGC``, "PodGC: node no longer
exists") and force-deleted (grace 0); a terminating unscheduled pod is marked ``Failed`` and
force-deleted likewise, without the condition. A pod already terminal keeps its phase; the
force delete still removes it unless finalizers hold it. The operator reads
``DeletionByPodGC`` as a preemption, as it would there.

Pure decisions here; :mod:`.controllers` runs them on a timer with what the store holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .disruption import disruption_target
from .podspec import TERMINAL_PHASES

Obj = dict[str, Any]

#: Seconds between passes, and how long a node must stay missing before its pods are
#: collected (kube-controller-manager's ``gcCheckPeriod`` and ``quarantineTime``).
POD_GC = (20.0, 40.0)
ORPHANED_REASON = "DeletionByPodGC"
ORPHANED_MESSAGE = "PodGC: node no longer exists"


@dataclass(frozen=True)
class Collect:
    """One pod to mark ``Failed`` and force-delete; ``orphaned``: its node is gone (the
    ``DisruptionTarget`` condition is written), else it was deleted unscheduled."""

    namespace: str
    name: str
    uid: str
    orphaned: bool


def missing_nodes(
    pods: Iterable[Obj],
    nodes: set[str],
    missing_since: Mapping[str, float],
    now: float,
) -> dict[str, float]:
    """The nodes pods are bound to that do not exist, each with the time it was first seen
    missing (kept from ``missing_since``, else ``now``): a node back meanwhile drops out."""
    bound = {(pod.get("spec") or {}).get("nodeName") or "" for pod in pods}
    return {node: missing_since.get(node, now) for node in sorted(bound - nodes - {""})}


def plan(
    pods: Iterable[Obj],
    missing_since: Mapping[str, float],
    now: float,
    quarantine: float,
) -> list[Collect]:
    """The pods one pass collects: bound to a node missing for at least ``quarantine``
    seconds, or being deleted without ever having been bound."""
    gone = {node for node, since in missing_since.items() if now - since >= quarantine}
    out = []
    for pod in pods:
        meta, node = pod["metadata"], (pod.get("spec") or {}).get("nodeName") or ""
        if node in gone or (not node and meta.get("deletionTimestamp")):
            out.append(Collect(meta.get("namespace", ""), meta["name"], meta["uid"], bool(node)))
    return out


def failed_status(status: Obj, orphaned: bool, now: datetime) -> Obj | None:
    """The status PodGC writes before its delete (None: none, the pod is already terminal):
    ``Failed``, with ``DisruptionTarget`` for a pod whose node is gone."""
    if status.get("phase") in TERMINAL_PHASES:
        return None
    failed = {**status, "phase": "Failed"}
    if orphaned:
        failed = disruption_target(failed, ORPHANED_REASON, ORPHANED_MESSAGE, now)
    return failed

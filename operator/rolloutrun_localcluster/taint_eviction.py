"""Taint-based eviction, as a real cluster does it for a node that stops answering: the
``DefaultTolerationSeconds`` admission plugin and the taint eviction controller.

Why: a real cluster gives every pod that does not say otherwise 300 s of toleration for the
``node.kubernetes.io/not-ready`` and ``node.kubernetes.io/unreachable`` ``NoExecute``
taints, and kube-controller-manager's taint eviction controller deletes a pod once its node
carries a ``NoExecute`` taint the pod does not tolerate, or tolerates for a time that has
run out: ``DisruptionTarget=True`` (``DeletionByTaintManager``, "Taint manager: deleting due
to NoExecute taint"), then a graceful delete, which stays ``Terminating`` while the node's
kubelet is away. Without it a lost node's pods stayed here until the operator acted; a run
whose ``nodeLossTimeoutSeconds`` is past 300 would see them go at 300 s on a real cluster
and not here, and ``kubectl get pod -o yaml`` would show fewer tolerations than there.

The rules (``plugin/pkg/admission/defaulttolerationseconds``, ``pkg/controller/tainteviction``):
the plugin adds each of the two tolerations (``Exists``, ``NoExecute``, 300 s) to a new pod
that has no toleration of that key (or of every key) with effect ``NoExecute`` (or every
effect). The controller takes, per ``NoExecute`` taint of the node, the first toleration
that matches it; a taint none matches means now; else the shortest ``tolerationSeconds``
among those (none: for ever; zero or less: now) from when the node was first tainted.
Pure functions here; :mod:`.strategies` admits, :mod:`.controllers` evicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

Obj = dict[str, Any]

NO_EXECUTE = "NoExecute"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
#: The admission plugin's default for both taints (``--default-*-toleration-seconds``).
DEFAULT_TOLERATION_SECONDS = 300
EVICTION_REASON = "DeletionByTaintManager"
EVICTION_MESSAGE = "Taint manager: deleting due to NoExecute taint"


def with_default_tolerations(tolerations: list[Obj]) -> list[Obj]:
    """``tolerations`` with the plugin's two added where the pod tolerates neither taint."""
    out = list(tolerations)
    for key in (NOT_READY_TAINT, UNREACHABLE_TAINT):
        covered = any(
            toleration.get("key") in (None, "", key)
            and toleration.get("effect") in (None, "", NO_EXECUTE)
            for toleration in tolerations
        )
        if not covered:
            out.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": NO_EXECUTE,
                    "tolerationSeconds": DEFAULT_TOLERATION_SECONDS,
                }
            )
    return out


def toleration_matches(toleration: Obj, taint: Obj) -> bool:
    """Whether ``toleration`` tolerates ``taint`` (its effect, if named, and its key: any
    with ``Exists`` and no key, else that key, and for ``Equal`` that value)."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get(
        "value", ""
    )


def no_execute_taints(node: Obj) -> list[Obj]:
    return [
        t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") == NO_EXECUTE
    ]


def eviction_due(tolerations: Iterable[Obj], taints: list[Obj], now: datetime) -> datetime | None:
    """When a pod with ``tolerations`` on a node with ``taints`` (its ``NoExecute`` ones) is
    deleted: ``now`` if one is not tolerated, else when the shortest toleration used runs out
    from the first taint's ``timeAdded``; None if never (no such taint, tolerated for ever)."""
    if not taints:
        return None
    tolerations = list(tolerations)
    seconds: list[float] = []
    for taint in taints:
        used = next((t for t in tolerations if toleration_matches(t, taint)), None)
        if used is None:
            return now
        if used.get("tolerationSeconds") is not None:
            seconds.append(float(used["tolerationSeconds"]))
    if not seconds:
        return None
    if min(seconds) <= 0:
        return now
    # imported here: .store imports .strategies, which imports this module, before .store's
    # time helpers exist
    from .table_printers import parse_time

    added = [parse_time(t.get("timeAdded")) for t in taints]
    since = min((moment for moment in added if moment is not None), default=now)
    return since + timedelta(seconds=min(seconds))

"""Garbage collection and namespace termination decisions, as pure functions.

The real garbage collector classifies each owner of a dependent as *solid* (exists, not
being deleted in the foreground), *dangling* (gone, or a different uid) or *waiting* (being
deleted with ``propagationPolicy=Foreground``), and then:

- no solid owner, some waiting: delete the dependent in the foreground;
- no solid owner at all: delete the dependent (background);
- solid owners and some dangling/waiting ones: drop those references;
- an owner with the ``orphan`` finalizer: drop its references from every dependent, then the
  finalizer; with ``foregroundDeletion``: remove the finalizer once no dependent is left.

A namespace being deleted has every object in it deleted, and is finalized when it is empty.
``plan`` computes these actions from a snapshot of all objects; the controller applies them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
MANAGED_BY = "endpoints.kubernetes.io/managed-by"


@dataclass(frozen=True)
class Target:
    """An object by storage key, namespace and name (and the uid it must still have)."""

    storage_key: str
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class Action:
    verb: str  # "delete", "unown", "finalize", "finalize-namespace"
    target: Target
    policy: str = "Background"  # for "delete"
    owner_uid: str = ""  # for "unown"
    finalizer: str = ""  # for "finalize"


def target_of(storage_key: str, obj: Obj) -> Target:
    meta = obj["metadata"]
    return Target(storage_key, meta.get("namespace", ""), meta["name"], meta["uid"])


def _deleting(obj: Obj) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def _finalizers(obj: Obj) -> list[str]:
    return list(obj["metadata"].get("finalizers") or [])


def plan(objects: Iterable[tuple[str, Obj]]) -> list[Action]:
    """All garbage-collection and namespace actions due for this snapshot of the cluster."""
    everything = list(objects)
    by_uid = {obj["metadata"]["uid"]: obj for _, obj in everything}
    dependents: dict[str, list[tuple[str, Obj]]] = {}
    actions: list[Action] = []
    for key, obj in everything:
        references = obj["metadata"].get("ownerReferences") or []
        for reference in references:
            dependents.setdefault(reference.get("uid", ""), []).append((key, obj))
        if references:
            actions += _dependent_actions(key, obj, references, by_uid)
    for key, obj in everything:
        if not _deleting(obj):
            continue
        finalizers = _finalizers(obj)
        uid = obj["metadata"]["uid"]
        if "orphan" in finalizers:
            actions += [
                Action("unown", target_of(dkey, dep), owner_uid=uid)
                for dkey, dep in dependents.get(uid, [])
            ]
            actions.append(Action("finalize", target_of(key, obj), finalizer="orphan"))
        elif "foregroundDeletion" in finalizers and not dependents.get(uid):
            actions.append(Action("finalize", target_of(key, obj), finalizer="foregroundDeletion"))
    actions += _namespace_actions(everything)
    return actions


def _dependent_actions(
    key: str, obj: Obj, references: list[Obj], by_uid: dict[str, Obj]
) -> list[Action]:
    solid, dangling, waiting = [], [], []
    for reference in references:
        owner = by_uid.get(reference.get("uid", ""))
        if owner is None:
            dangling.append(reference)
        elif _deleting(owner) and "foregroundDeletion" in _finalizers(owner):
            waiting.append(reference)
        elif _deleting(owner) and "orphan" in _finalizers(owner):
            continue  # the orphan pass drops this reference
        else:
            solid.append(reference)
    target = target_of(key, obj)
    if not solid and (dangling or waiting):
        if _deleting(obj):
            return []
        return [Action("delete", target, policy="Foreground" if waiting else "Background")]
    return [Action("unown", target, owner_uid=ref.get("uid", "")) for ref in dangling + waiting]


def _namespace_actions(everything: list[tuple[str, Obj]]) -> list[Action]:
    terminating = {
        obj["metadata"]["name"]: (key, obj)
        for key, obj in everything
        if key == "namespaces" and _deleting(obj)
    }
    if not terminating:
        return []
    actions: list[Action] = []
    occupied: set[str] = set()
    for key, obj in everything:
        namespace = obj["metadata"].get("namespace", "")
        if namespace in terminating:
            occupied.add(namespace)
            if not _deleting(obj):
                actions.append(Action("delete", target_of(key, obj)))
    for name, (key, obj) in terminating.items():
        if name not in occupied:
            actions.append(Action("finalize-namespace", target_of(key, obj)))
    return actions


def selects(selector: Obj, labels: Obj) -> bool:
    """Whether a Service's ``selector`` (a map, every pair required) matches ``labels``."""
    return all(labels.get(key) == value for key, value in selector.items())


def endpoints_for(service: Obj, pods: Iterable[Obj]) -> Obj | None:
    """The ``Endpoints`` of a Service: its selected pods' IPs, ready or not ready.

    ``None`` for a Service without a selector (its endpoints are managed by hand)."""
    selector = (service.get("spec") or {}).get("selector")
    if not selector:
        return None
    meta = service["metadata"]
    ready: list[Obj] = []
    not_ready: list[Obj] = []
    chosen: list[Obj] = []
    for pod in pods:
        pod_meta = pod["metadata"]
        labels = pod_meta.get("labels") or {}
        if pod_meta.get("namespace") != meta.get("namespace"):
            continue
        if not selects(selector, labels):
            continue
        status = pod.get("status") or {}
        if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        address = {
            "ip": status["podIP"],
            "nodeName": (pod.get("spec") or {}).get("nodeName", ""),
            "targetRef": {
                "kind": "Pod",
                "namespace": pod_meta.get("namespace"),
                "name": pod_meta["name"],
                "uid": pod_meta["uid"],
            },
        }
        is_ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if is_ready and not pod_meta.get("deletionTimestamp"):
            ready.append(address)
        else:
            not_ready.append(address)
        chosen.append(pod)
    ports = [
        _endpoint_port(port, chosen) for port in (service.get("spec") or {}).get("ports") or []
    ]
    subsets: list[Obj] = []
    if ready or not_ready:
        subset: Obj = {"ports": [p for p in ports if p is not None]}
        if ready:
            subset["addresses"] = sorted(ready, key=lambda a: a["ip"])
        if not_ready:
            subset["notReadyAddresses"] = sorted(not_ready, key=lambda a: a["ip"])
        subsets.append(subset)
    return {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "labels": {**(meta.get("labels") or {}), MANAGED_BY: "endpoint-controller"},
        },
        "subsets": subsets,
    }


def _endpoint_port(port: Obj, pods: list[Obj]) -> Obj | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, str) and not target.isdigit():
        for pod in pods:
            for container in (pod.get("spec") or {}).get("containers") or []:
                for container_port in container.get("ports") or []:
                    if container_port.get("name") == target:
                        target = container_port.get("containerPort")
                        break
        if not isinstance(target, int):
            return None
    if target is None:
        return None
    result: Obj = {"port": int(target), "protocol": port.get("protocol", "TCP")}
    if port.get("name"):
        result["name"] = port["name"]
    return result

"""The scheduler: binds each new pod to a Ready node that fits, least-loaded first.

With several process kubelets (``LocalCluster(nodes=2)``) a node loss looks like one on a
real cluster: the lost node's pods stay bound to it, unready, while their replacements are
scheduled onto a node that still answers. A pod fits a node when the node is Ready, not
cordoned, its ``nodeSelector`` matches the node's labels and it tolerates the node's
``NoSchedule``/``NoExecute`` taints. Affinity, topology spread and resources are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from . import errors
from .passes import PassLoop
from .resources import Registry
from .storage_provisioner import claim_problem, scheduler_message
from .store import Event, Store, now_iso
from .taint_eviction import toleration_matches

logger = logging.getLogger(__name__)

Obj = dict[str, Any]


def tolerates(tolerations: Iterable[Obj], taint: Obj) -> bool:
    return any(toleration_matches(toleration, taint) for toleration in tolerations)


def node_fits(pod: Obj, node: Obj) -> str | None:
    """``None`` if ``pod`` may run on ``node``, else the reason it may not."""
    spec = pod.get("spec") or {}
    conditions = {
        c.get("type"): c.get("status") for c in (node.get("status") or {}).get("conditions") or []
    }
    if conditions.get("Ready") != "True":
        return "node(s) were not ready"
    node_spec = node.get("spec") or {}
    if node_spec.get("unschedulable"):
        return "node(s) were unschedulable"
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return "node(s) didn't match Pod's node affinity/selector"
    for taint in node_spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(
            spec.get("tolerations") or [], taint
        ):
            return "node(s) had untolerated taint"
    return None


def choose_node(pod: Obj, nodes: list[Obj], load: dict[str, int]) -> tuple[str | None, str]:
    """The node to bind to (fewest pods, then name), or ``None`` and the scheduler's message."""
    fitting: list[str] = []
    reasons: dict[str, int] = {}
    for node in nodes:
        reason = node_fits(pod, node)
        if reason is None:
            fitting.append(node["metadata"]["name"])
        else:
            reasons[reason] = reasons.get(reason, 0) + 1
    if fitting:
        return min(fitting, key=lambda name: (load.get(name, 0), name)), ""
    detail = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    return None, f"0/{len(nodes)} nodes are available: {detail}."


class Scheduler:
    def __init__(self, store: Store, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        self._passes = PassLoop(
            self.schedule,
            name="localcluster-scheduler",
            failure="scheduling pass failed",
            logger=logger,
        )
        store.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        if event.storage_key in ("pods", "nodes", "persistentvolumeclaims"):
            self._passes.mark_due()

    def start(self) -> None:
        self._passes.start()

    async def stop(self) -> None:
        await self._passes.stop()

    def schedule(self) -> None:
        pods_type = self.registry.get("", "v1", "pods")
        assert pods_type is not None
        pods = list(self.store.objects("pods"))
        nodes = sorted(self.store.objects("nodes"), key=lambda n: n["metadata"]["name"])
        load: dict[str, int] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                load[node] = load.get(node, 0) + 1
        for pod in pods:
            meta = pod["metadata"]
            if (pod.get("spec") or {}).get("nodeName") or meta.get("deletionTimestamp"):
                continue
            chosen, message = choose_node(pod, nodes, load)
            problem = claim_problem(pod, self._claim)
            if problem is not None:
                chosen, message = None, scheduler_message(problem, len(nodes))
            try:
                if chosen is None:
                    self._unschedulable(pod, message)
                else:
                    self._bind(pod, chosen)
                    load[chosen] = load.get(chosen, 0) + 1
            except errors.ApiError as error:
                logger.debug("pod %s/%s not bound: %s", meta["namespace"], meta["name"], error)

    def _claim(self, namespace: str, name: str) -> Obj | None:
        claims = self.registry.get("", "v1", "persistentvolumeclaims")
        return None if claims is None else self.store.find(claims, namespace, name)

    def _condition(self, pod: Obj, condition: Obj) -> Obj:
        status = dict(pod.get("status") or {})
        others = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        before: Obj = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
        )
        if before.get("status") == condition["status"] and before.get("message") == condition.get(
            "message"
        ):
            condition = before
        status["conditions"] = [condition, *others]
        return status

    def _bind(self, pod: Obj, node: str) -> None:
        pods = self.registry.get("", "v1", "pods")
        assert pods is not None
        meta = pod["metadata"]
        bound = self.store.update(
            pods,
            meta["namespace"],
            meta["name"],
            {**pod, "spec": {**pod["spec"], "nodeName": node}},
        )
        condition = {
            "type": "PodScheduled",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": now_iso(),
        }
        status = self._condition(bound, condition)
        self.store.update(
            pods, meta["namespace"], meta["name"], {**bound, "status": status}, subresource="status"
        )

    def _unschedulable(self, pod: Obj, message: str) -> None:
        pods = self.registry.get("", "v1", "pods")
        assert pods is not None
        meta = pod["metadata"]
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastProbeTime": None,
            "lastTransitionTime": now_iso(),
        }
        status = self._condition(pod, condition)
        self.store.update(
            pods, meta["namespace"], meta["name"], {**pod, "status": status}, subresource="status"
        )

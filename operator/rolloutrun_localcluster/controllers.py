"""The control-plane loops the API server alone does not do: garbage collection, namespace
termination, CRD registration, Services' Endpoints, PodDisruptionBudgets' status, each
namespace's default ServiceAccount and its ``kube-root-ca.crt`` ConfigMap, taint-based
eviction from a node that stopped answering, and PodGC's end of pods no kubelet will end.
They react to store events (debounced; PodGC on its timer) and apply the pure plans of
:mod:`.gc`, :mod:`.disruption`, :mod:`.taint_eviction` and :mod:`.podgc` through the same
store calls a client would make.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from . import disruption, errors, gc, podgc, taint_eviction
from .passes import PassLoop
from .resources import Registry, ResourceType
from .store import Event, Store

logger = logging.getLogger(__name__)

_GC_RELEVANT = ("DELETED",)
#: The ConfigMap a real cluster's root-ca-cert-publisher keeps in every namespace: the CA
#: that verifies the API server from inside a pod (projected service-account volumes and
#: charts mount it by this name).
ROOT_CA_CONFIG_MAP = "kube-root-ca.crt"
_ROOT_CA_DESCRIPTION = (
    "Contains a CA bundle that can be used to verify the kube-apiserver when using internal "
    "endpoints such as the internal service IP or kubernetes.default.svc. No other usage is "
    "guaranteed across distributions of Kubernetes clusters."
)


def root_ca_config_map(ca_pem: bytes) -> dict[str, Any]:
    """What the publisher keeps in each namespace: the CA under ``ca.crt``."""
    return {
        "metadata": {
            "name": ROOT_CA_CONFIG_MAP,
            "annotations": {"kubernetes.io/description": _ROOT_CA_DESCRIPTION},
        },
        "data": {"ca.crt": ca_pem.decode()},
    }


def root_ca_repair(current: dict[str, Any] | None, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The body that puts ``current`` (None: missing) back to ``wanted`` -- its data and the
    description, the rest (labels, other annotations) kept -- or None when it holds them."""
    if current is None:
        return wanted
    annotations = current["metadata"].get("annotations") or {}
    wanted_annotations = wanted["metadata"]["annotations"]
    if current.get("data") == wanted["data"] and wanted_annotations.items() <= annotations.items():
        return None
    metadata = {**current["metadata"], "annotations": {**annotations, **wanted_annotations}}
    return {**current, "metadata": metadata, "data": wanted["data"]}


class Controllers:
    """Runs on the cluster's loop; ``start`` it once, ``stop`` it on shutdown."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        ca_pem: bytes,
        debounce: float = 0.02,
        pod_gc: tuple[float, float] = podgc.POD_GC,
    ) -> None:
        """``pod_gc``: PodGC's period and node quarantine in seconds (tests shorten them)."""
        self.store = store
        self.registry = registry
        self._root_ca = root_ca_config_map(ca_pem)
        self._pod_gc = pod_gc
        self._pod_gc_task: asyncio.Task[None] | None = None
        #: Nodes pods are bound to that do not exist, since when (monotonic): the quarantine.
        self._missing_since: dict[str, float] = {}

        def loop(work: Callable[[], object], name: str) -> PassLoop:
            failure = "local cluster controller pass failed"
            return PassLoop(work, name=name, failure=failure, logger=logger, debounce=debounce)

        self._gc = loop(self.collect_garbage, "localcluster-gc")
        self._endpoints = loop(self.sync_endpoints, "localcluster-endpoints")
        self._budgets = loop(self.sync_budgets, "localcluster-disruption")
        self._budget_timer: asyncio.TimerHandle | None = None
        self._evictions = loop(self.evict_tainted, "localcluster-taint-eviction")
        self._eviction_timer: asyncio.TimerHandle | None = None
        # The Services whose Endpoints the next pass recomputes (None: every one). A pass
        # over every Service times every pod made a thousand runs' pod events quadratic.
        self._stale_endpoints: set[tuple[str, str]] | None = None
        # Services by (namespace, first pair of their selector), rebuilt after any Service
        # event: which Services a pod event concerns, without looking at every one.
        self._anchors: dict[tuple[str, str, str], list[dict[str, Any]]] | None = None
        store.subscribe(self._on_event)

    def _type(self, group: str, plural: str) -> ResourceType:
        for rtype in self.registry.all():
            if rtype.group == group and rtype.plural == plural:
                return rtype
        raise KeyError(plural)

    def _on_event(self, event: Event) -> None:
        obj = event.obj
        meta = obj["metadata"]
        if event.storage_key == "customresourcedefinitions.apiextensions.k8s.io":
            self._on_crd(event)
        if event.type == "ADDED" and event.storage_key == "namespaces":
            self._default_service_account(meta["name"])
            self._publish_root_ca(meta["name"])
        if event.storage_key == "configmaps" and meta["name"] == ROOT_CA_CONFIG_MAP:
            self._publish_root_ca(meta.get("namespace", ""))  # deleted or edited: put back
        old_references = (event.old or {}).get("metadata", {}).get("ownerReferences")
        references_changed = meta.get("ownerReferences") != old_references
        owners = [*(meta.get("ownerReferences") or []), *(old_references or [])]
        settled = not references_changed or self._owners_live(owners)
        if event.type == "DELETED" or meta.get("deletionTimestamp") or not settled:
            self._gc.mark_due()
        if event.storage_key in ("pods", "services"):
            self._endpoints_due(event)
        if event.storage_key in ("pods", disruption.STORAGE_KEY):
            self._budgets.mark_due()
        if event.storage_key in ("pods", "nodes"):
            self._evictions.mark_due()

    def _owners_live(self, references: list[dict[str, Any]]) -> bool:
        """Whether every owner an object names (or named) exists and is not being deleted:
        then a new or changed reference leaves the collector nothing to do (a full pass looks at
        every object, and each of a thousand runs' children is created owned)."""
        for reference in references:
            owner = self.store.by_uid(str(reference.get("uid") or ""))
            if owner is None or owner["metadata"].get("deletionTimestamp"):
                return False
        return True

    def _on_crd(self, event: Event) -> None:
        name = event.obj["metadata"]["name"]
        if event.type == "DELETED":
            for rtype in self.registry.remove_crd(name)[:1]:
                for obj in list(self.store.objects(rtype.storage_key)):
                    meta = obj["metadata"]
                    self.store.remove_now(rtype, meta.get("namespace", ""), meta["name"])
        elif not event.obj["metadata"].get("deletionTimestamp"):
            self.registry.put_crd(event.obj)

    def _default_service_account(self, namespace: str) -> None:
        rtype = self._type("", "serviceaccounts")
        if self.store.find(rtype, namespace, "default") is None:
            with contextlib.suppress(errors.ApiError):
                self.store.create(rtype, namespace, {"metadata": {"name": "default"}})

    def _publish_root_ca(self, namespace: str) -> None:
        """Keep ``kube-root-ca.crt`` in ``namespace`` as the publisher does: made, and put
        back when deleted or edited, except in a namespace being deleted."""
        space = self.store.find(self._type("", "namespaces"), "", namespace)
        if space is None or space["metadata"].get("deletionTimestamp"):
            return
        rtype = self._type("", "configmaps")
        current = self.store.find(rtype, namespace, ROOT_CA_CONFIG_MAP)
        if current is not None and current["metadata"].get("deletionTimestamp"):
            return  # its finalizers hold it; the DELETED event brings it back
        body = root_ca_repair(current, self._root_ca)
        if body is None:
            return
        with contextlib.suppress(errors.ApiError):  # a concurrent writer: its event comes next
            if current is None:
                self.store.create(rtype, namespace, body)
            else:
                self.store.update(rtype, namespace, ROOT_CA_CONFIG_MAP, body)

    def start(self) -> None:
        self._gc.start()
        self._endpoints.start()
        self._budgets.start()
        self._evictions.start()
        self._pod_gc_task = asyncio.create_task(self._pod_gc_loop(), name="localcluster-podgc")

    async def stop(self) -> None:
        for timer in (self._budget_timer, self._eviction_timer):
            if timer is not None:
                timer.cancel()
        if self._pod_gc_task is not None:
            self._pod_gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pod_gc_task
        loops = (self._gc, self._endpoints, self._budgets, self._evictions)
        for loop in loops:
            loop.cancel()
        for loop in loops:
            await loop.stop()

    # ------------------------------------------------------------ taint-based eviction
    def evict_tainted(self) -> int:
        """The taint eviction controller's pass (:mod:`.taint_eviction`): delete the pods
        whose node's ``NoExecute`` taints they no longer tolerate; the number deleted. A pass
        is due again when the next toleration runs out."""
        if self._eviction_timer is not None:
            self._eviction_timer.cancel()
            self._eviction_timer = None
        tainted = {
            node["metadata"]["name"]: taints
            for node in self.store.objects("nodes")
            if (taints := taint_eviction.no_execute_taints(node))
        }
        if not tainted:
            return 0
        now = _now()
        evicted, later = 0, []
        for pod in list(self.store.objects("pods")):
            spec, meta = pod.get("spec") or {}, pod["metadata"]
            on_node = tainted.get(spec.get("nodeName") or "")
            if not on_node or meta.get("deletionTimestamp"):
                continue
            due = taint_eviction.eviction_due(spec.get("tolerations") or [], on_node, now)
            if due is None:
                continue
            if due > now:
                later.append(due)
                continue
            try:
                self._evict(pod)
                evicted += 1
            except errors.ApiError as error:
                logger.debug("eviction of %s/%s: %s", meta.get("namespace"), meta["name"], error)
                self._evictions.mark_due()
        if later:
            wait = (min(later) - now).total_seconds()
            loop = asyncio.get_running_loop()
            self._eviction_timer = loop.call_later(wait, self._evictions.mark_due)
        return evicted

    def _evict(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        status = disruption.disruption_target(
            dict(pod.get("status") or {}),
            taint_eviction.EVICTION_REASON,
            taint_eviction.EVICTION_MESSAGE,
            _now(),
        )
        logger.info("taint eviction: deleting pod %s/%s", meta.get("namespace"), meta["name"])
        self._write_status_and_delete(pod, status, {"preconditions": {"uid": meta["uid"]}})

    def _write_status_and_delete(
        self, pod: dict[str, Any], status: dict[str, Any] | None, options: dict[str, Any]
    ) -> None:
        """What taint eviction and PodGC do to a pod: ``status`` (None: none) written at the
        version read, so whoever sees the pod go reads why, then the delete (``options``)."""
        meta = pod["metadata"]
        namespace, name = meta.get("namespace", ""), meta["name"]
        rtype = self._type("", "pods")
        if status is not None:
            self.store.update(
                rtype,
                namespace,
                name,
                {**pod, "status": status},
                subresource="status",
                precondition_rv=meta["resourceVersion"],
            )
        self.store.delete(rtype, namespace, name, options)

    # ------------------------------------------------------------ PodGC
    async def _pod_gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self._pod_gc[0])
            try:
                self.collect_pods()
            except Exception:
                logger.exception("local cluster PodGC pass failed")

    def collect_pods(self) -> int:
        """One PodGC pass (:mod:`.podgc`); the number of pods collected."""
        pods = list(self.store.objects("pods"))
        nodes = {node["metadata"]["name"] for node in self.store.objects("nodes")}
        now = time.monotonic()
        self._missing_since = podgc.missing_nodes(pods, nodes, self._missing_since, now)
        collected = 0
        for action in podgc.plan(pods, self._missing_since, now, self._pod_gc[1]):
            try:
                collected += self._collect_pod(action)
            except errors.ApiError as error:
                if error.code not in (404, 409):
                    logger.warning(
                        "PodGC of %s/%s failed: %s", action.namespace, action.name, error
                    )
        return collected

    def _collect_pod(self, action: podgc.Collect) -> int:
        """Mark the pod ``Failed`` (unless terminal) and force-delete it; 0 if it was
        collected already (a finalizer holds it) or is another pod of that name now."""
        rtype = self._type("", "pods")
        pod = self.store.find(rtype, action.namespace, action.name)
        if pod is None or pod["metadata"]["uid"] != action.uid:
            return 0
        status = podgc.failed_status(dict(pod.get("status") or {}), action.orphaned, _now())
        if status is None and pod["metadata"].get("deletionTimestamp"):
            return 0
        logger.info("PodGC is force deleting pod %s/%s", action.namespace, action.name)
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": action.uid}}
        self._write_status_and_delete(pod, status, options)
        return 1

    # ------------------------------------------------------------ garbage collection
    def _all_objects(self) -> list[tuple[str, dict[str, Any]]]:
        keys = {rtype.storage_key for rtype in self.registry.all()}
        return [(key, obj) for key in sorted(keys) for obj in self.store.objects(key)]

    def collect_garbage(self) -> int:
        """Apply one GC plan; return the number of actions taken."""
        actions = gc.plan(self._all_objects())
        for action in actions:
            try:
                self._apply(action)
            except errors.ApiError as error:
                if error.code not in (404, 409):
                    logger.warning(
                        "garbage collection %s of %s failed: %s", action.verb, action.target, error
                    )
        if actions:
            self._gc.mark_due()  # dependents of what was just deleted may be due now
        return len(actions)

    def _apply(self, action: gc.Action) -> None:
        target = action.target
        types = self.registry.by_storage_key(target.storage_key)
        if not types:
            return
        rtype = types[0]
        current = self.store.find(rtype, target.namespace, target.name)
        if current is None or current["metadata"]["uid"] != target.uid:
            return
        meta = current["metadata"]
        if action.verb == "delete":
            options = {"propagationPolicy": action.policy, "preconditions": {"uid": target.uid}}
            logger.debug(
                "garbage collecting %s %s/%s", target.storage_key, target.namespace, target.name
            )
            self.store.delete(rtype, target.namespace, target.name, options)
        elif action.verb == "unown":
            references = [
                r for r in meta.get("ownerReferences") or [] if r.get("uid") != action.owner_uid
            ]
            body = {**current, "metadata": {**meta, "ownerReferences": references}}
            if not references:
                body["metadata"].pop("ownerReferences")
            self.store.update(
                rtype, target.namespace, target.name, body, precondition_rv=meta["resourceVersion"]
            )
        elif action.verb == "finalize":
            finalizers = [f for f in meta.get("finalizers") or [] if f != action.finalizer]
            body = {**current, "metadata": {**meta, "finalizers": finalizers}}
            self.store.update(
                rtype, target.namespace, target.name, body, precondition_rv=meta["resourceVersion"]
            )
        elif action.verb == "finalize-namespace":
            spec = {**(current.get("spec") or {}), "finalizers": []}
            self.store.update(rtype, "", target.name, {**current, "spec": spec})

    # ------------------------------------------------------------ endpoints
    def _endpoints_due(self, event: Event) -> None:
        """Mark the Services an event of a pod or Service may change the Endpoints of: the
        Service itself, or those of the pod's namespace whose selector matches the pod's
        labels before or after."""
        meta = event.obj["metadata"]
        namespace = meta.get("namespace", "")
        stale = self._stale_endpoints
        if event.storage_key == "services":
            self._anchors = None
            if stale is not None:
                stale.add((namespace, meta["name"]))
        elif stale is not None:
            old_labels = ((event.old or {}).get("metadata") or {}).get("labels") or {}
            for labels in (meta.get("labels") or {}, old_labels):
                for service in self._selecting(namespace, labels):
                    stale.add((namespace, service["metadata"]["name"]))
        self._endpoints.mark_due()

    def _selecting(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The Services of ``namespace`` whose selector matches ``labels``: those whose
        anchor (the pair of their selector fewest Services share, such as the run's name
        rather than the role) the labels hold (:attr:`_anchors`), checked in full."""
        if self._anchors is None:
            selected = [
                (service["metadata"].get("namespace", ""), service, selector)
                for service in self.store.objects("services")
                if (selector := (service.get("spec") or {}).get("selector"))
            ]
            shared = Counter(
                (where, *pair) for where, _, selector in selected for pair in selector.items()
            )
            self._anchors = {}
            for where, service, selector in selected:
                pairs = [(where, *pair) for pair in selector.items()]
                anchor = min(pairs, key=lambda each: (shared[each], each))
                self._anchors.setdefault(anchor, []).append(service)
        found = []
        for pair in labels.items():
            for service in self._anchors.get((namespace, *pair), ()):
                if gc.selects(service["spec"]["selector"], labels):
                    found.append(service)
        return found

    def sync_endpoints(self) -> None:
        """Each stale Service's Endpoints from the pods of its namespace (every Service's on
        the first pass); those of a Service gone are deleted."""
        services = self._type("", "services")
        endpoints = self._type("", "endpoints")
        stale, self._stale_endpoints = self._stale_endpoints, set()
        if stale is None:
            chosen = list(self.store.objects("services"))
        else:
            found = (self.store.find(services, *key) for key in sorted(stale))
            chosen = [service for service in found if service is not None]
        wanted: dict[tuple[str, str], dict[str, Any]] = {}
        for service in chosen:
            if service["metadata"].get("deletionTimestamp"):
                continue
            namespace = service["metadata"]["namespace"]
            body = gc.endpoints_for(service, self.store.objects_in("pods", namespace))
            if body is not None:
                wanted[(namespace, service["metadata"]["name"])] = body
        for (namespace, name), body in wanted.items():
            current = self.store.find(endpoints, namespace, name)
            try:
                if current is None:
                    self.store.create(endpoints, namespace, body)
                elif current.get("subsets") != body["subsets"]:
                    self.store.update(
                        endpoints, namespace, name, {**current, "subsets": body["subsets"]}
                    )
            except errors.ApiError as error:
                logger.debug("endpoints %s/%s not synced: %s", namespace, name, error)
        if stale is None:
            leftover = list(self.store.objects("endpoints"))
        else:
            found = (self.store.find(endpoints, *key) for key in sorted(stale))
            leftover = [current for current in found if current is not None]
        for current in leftover:
            meta = current["metadata"]
            key = (meta["namespace"], meta["name"])
            had_service = self.store.find(services, *key)
            managed = (meta.get("labels") or {}).get(gc.MANAGED_BY) == "endpoint-controller"
            gone = had_service is None or had_service["metadata"].get("deletionTimestamp")
            if key not in wanted and managed and gone:
                with contextlib.suppress(errors.ApiError):
                    self.store.delete(endpoints, *key)

    # ------------------------------------------------------------ disruption budgets
    def sync_budgets(self) -> None:
        """The disruption controller: each budget's status from the pods it covers."""
        budgets = list(self.store.objects(disruption.STORAGE_KEY))
        if not budgets:
            return
        rtype = self._type("policy", "poddisruptionbudgets")
        pods = list(self.store.objects("pods"))
        now = _now()
        expiries: list[float] = []
        for budget in budgets:
            meta = budget["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            status = disruption.budget_status(budget, pods, self.store.by_uid, now)
            expiry = disruption.next_expiry(status, now)
            if expiry is not None:
                expiries.append(expiry)
            if status == budget.get("status"):
                continue
            try:
                self.store.update(
                    rtype,
                    meta["namespace"],
                    meta["name"],
                    {**budget, "status": status},
                    subresource="status",
                    precondition_rv=meta["resourceVersion"],
                )
            except errors.ApiError as error:
                logger.debug("budget %s/%s not synced: %s", meta["namespace"], meta["name"], error)
                self._budgets.mark_due()
        if self._budget_timer is not None:
            self._budget_timer.cancel()
        self._budget_timer = None
        if expiries:  # an eviction whose pod was never deleted stops counting then
            loop = asyncio.get_running_loop()
            self._budget_timer = loop.call_later(min(expiries) + 1, self._budgets.mark_due)


def _now() -> datetime:
    return datetime.now(UTC)

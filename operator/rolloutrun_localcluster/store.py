"""The object store: resource versions, optimistic concurrency, deletion and the watch log.

Everything the API promises about consistency lives here. One global counter stamps every
write with a ``resourceVersion``; every write appends an event to a bounded history that
watches replay from (a watch from a version older than the history is a ``410 Gone``, as
after etcd compaction); a write that changes nothing is not a write (no new version, no
event, as on the real server, which keeps Kopf from looping on its own patches).

The store runs on one asyncio loop and never awaits, so each call is atomic. Stored objects
are never mutated in place: a write stores a new dict, so readers may share them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from . import errors
from .patches import json_copy
from .resources import Registry, ResourceType
from .selectors import FieldRequirement, Requirement, fields_match, labels_match
from .strategies import Strategy, strategy_for

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
# Computes ``metadata.managedFields`` of a write from the old (None on create) and new object.
Managed = Callable[[Obj | None, Obj], list[Obj]]


def rfc3339(moment: datetime) -> str:
    """A time as the API writes ``metav1.Time``: RFC 3339 in UTC, whole seconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_iso(offset: float = 0.0) -> str:
    return rfc3339(datetime.now(UTC) + timedelta(seconds=offset))


@dataclass
class Event:
    """One committed write, as watches see it. ``old`` is the previous state, if any."""

    rv: int
    storage_key: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None
    _lines: dict[str, bytes] = field(default_factory=dict, repr=False)

    def line(self, event_type: str, api_version: str) -> bytes:
        """The newline-delimited JSON line for this event, serialized once per version."""
        cache_key = f"{event_type}|{api_version}"
        if cache_key not in self._lines:
            obj = render(self.obj, api_version)
            self._lines[cache_key] = (
                json.dumps({"type": event_type, "object": obj}).encode() + b"\n"
            )
        return self._lines[cache_key]


def render(obj: Obj, api_version: str) -> Obj:
    """The object as served at ``api_version`` (all versions share one schema here)."""
    if obj.get("apiVersion") == api_version:
        return obj
    return {**obj, "apiVersion": api_version}


def transition(event_type: str, old_matches: bool, new_matches: bool) -> str | None:
    """What a filtered watch sees of an event: selector entries and exits become
    ADDED and DELETED, as on the real server; ``None`` means nothing."""
    if event_type == "ADDED":
        return "ADDED" if new_matches else None
    if event_type == "DELETED":
        return "DELETED" if new_matches else None
    if old_matches and new_matches:
        return "MODIFIED"
    if new_matches:
        return "ADDED"
    if old_matches:
        return "DELETED"
    return None


@dataclass(eq=False)
class Watcher:
    storage_key: str
    namespace: str | None
    labels: list[Requirement]
    fields: list[FieldRequirement]
    queue: asyncio.Queue[tuple[str, Event]] = field(default_factory=asyncio.Queue)

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace", "") != self.namespace:
            return False
        return labels_match(self.labels, meta.get("labels")) and fields_match(self.fields, obj)

    def offer(self, event: Event) -> None:
        seen = transition(event.type, self.matches(event.old), self.matches(event.obj))
        if seen is not None:
            self.queue.put_nowait((seen, event))


_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"


class Store:
    """All objects of the cluster, keyed by resource storage key and (namespace, name)."""

    def __init__(self, registry: Registry, history: int = 50_000) -> None:
        self.registry = registry
        self._objects: dict[str, dict[Key, Obj]] = {}
        # The same objects by storage key and namespace: RBAC reads a namespace's
        # RoleBindings on every request, and a thousand runs each bring their own.
        self._namespaced: dict[str, dict[str, dict[Key, Obj]]] = {}
        self._uids: dict[str, tuple[str, Key]] = {}
        self._rv = itertools.count(1)
        self._current = 0
        self._history: deque[Event] = deque(maxlen=history)
        self._compacted = 0
        self._watchers: dict[str, set[Watcher]] = {}
        self._listeners: list[Callable[[Event], None]] = []
        self._random = uuid.uuid4

    # ----------------------------------------------------------------- reading
    @property
    def resource_version(self) -> int:
        return self._current

    def objects(self, storage_key: str) -> Iterable[Obj]:
        return list(self._objects.get(storage_key, {}).values())

    def objects_in(self, storage_key: str, namespace: str) -> list[Obj]:
        """The objects of one namespace (cluster-scoped ones: ``""``), in no set order."""
        return list(self._namespaced.get(storage_key, {}).get(namespace, {}).values())

    def find(self, rtype: ResourceType, namespace: str, name: str) -> Obj | None:
        key = (namespace if rtype.namespaced else "", name)
        return self._objects.get(rtype.storage_key, {}).get(key)

    def by_uid(self, uid: str) -> Obj | None:
        where = self._uids.get(uid)
        if where is None:
            return None
        return self._objects.get(where[0], {}).get(where[1])

    def get(self, rtype: ResourceType, namespace: str, name: str) -> Obj:
        obj = self.find(rtype, namespace, name)
        if obj is None:
            raise errors.not_found(rtype.plural, rtype.group, name)
        return render(obj, rtype.api_version)

    def list_objects(
        self,
        rtype: ResourceType,
        namespace: str | None,
        labels: list[Requirement] | None = None,
        fields: list[FieldRequirement] | None = None,
    ) -> list[Obj]:
        matcher = Watcher(rtype.storage_key, namespace, labels or [], fields or [])
        candidates = (
            self._objects.get(rtype.storage_key, {}).values()
            if namespace is None
            else self.objects_in(rtype.storage_key, namespace)
        )
        items = [render(obj, rtype.api_version) for obj in candidates if matcher.matches(obj)]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return items

    # ----------------------------------------------------------------- watching
    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` synchronously after every committed write (controllers)."""
        self._listeners.append(listener)

    def watch(self, watcher: Watcher, since: int | None) -> list[Event]:
        """Register ``watcher``; return the history after ``since`` to replay first."""
        if since is not None and since < self._compacted:
            raise errors.expired(f"too old resource version: {since} ({self._compacted + 1})")
        replay = []
        if since is not None:
            replay = [
                e for e in self._history if e.rv > since and e.storage_key == watcher.storage_key
            ]
        self._watchers.setdefault(watcher.storage_key, set()).add(watcher)
        return replay

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.get(watcher.storage_key, set()).discard(watcher)

    def watcher_count(self) -> int:
        return sum(len(ws) for ws in self._watchers.values())

    def compact(self) -> None:
        """Forget the watch history, as etcd compaction does: older versions get 410."""
        self._history.clear()
        self._compacted = self._current

    def _commit(self, rtype: ResourceType, event_type: str, obj: Obj, old: Obj | None) -> Obj:
        rv = next(self._rv)
        self._current = rv
        meta = dict(obj["metadata"])
        meta["resourceVersion"] = str(rv)
        obj = {**obj, "metadata": meta}
        objects = self._objects.setdefault(rtype.storage_key, {})
        key = (meta.get("namespace", ""), meta["name"])
        in_namespace = self._namespaced.setdefault(rtype.storage_key, {}).setdefault(key[0], {})
        if event_type == "DELETED":
            objects.pop(key, None)
            in_namespace.pop(key, None)
            self._uids.pop(meta["uid"], None)
        else:
            objects[key] = obj
            in_namespace[key] = obj
            self._uids[meta["uid"]] = (rtype.storage_key, key)
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].rv
        event = Event(rv, rtype.storage_key, event_type, obj, old)
        self._history.append(event)
        for watcher in list(self._watchers.get(rtype.storage_key, ())):
            watcher.offer(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("store listener failed on %s %s", event_type, key)
        return obj

    # ----------------------------------------------------------------- writing
    def create(
        self,
        rtype: ResourceType,
        namespace: str,
        body: Obj,
        *,
        dry_run: bool = False,
        strict: bool = False,
        managed: Managed | None = None,
    ) -> Obj:
        strategy = strategy_for(rtype)
        obj = json_copy(body)
        if not isinstance(obj, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        self._check_kind(rtype, obj)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be an object")
        if rtype.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            meta["namespace"] = namespace
            self._check_namespace(namespace)
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise errors.invalid(
                    rtype.kind,
                    rtype.group,
                    "",
                    [
                        (
                            "FieldValueRequired",
                            "metadata.name",
                            "metadata.name: Required value: name or generateName is required",
                        )
                    ],
                )
            suffix = "".join(_NAME_CHARS[b % len(_NAME_CHARS)] for b in self._random().bytes[:5])
            # The base is cut to 58 characters, as the server's name generator does.
            meta["name"] = meta["generateName"][:58] + suffix
        for dropped in (
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "managedFields",
        ):
            meta.pop(dropped, None)
        meta["uid"] = str(self._random())
        meta["creationTimestamp"] = now_iso()
        meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        if rtype.has_status and rtype.custom:
            obj.pop("status", None)
        warnings = strategy.prepare_create(rtype, obj, self, strict)
        self._validate(rtype, strategy, obj)
        if self.find(rtype, namespace, meta["name"]) is not None:
            raise errors.already_exists(rtype.plural, rtype.group, meta["name"])
        self._check_quota(rtype, namespace, meta["name"])
        _record(managed, None, obj)
        if dry_run:
            return obj
        stored = self._commit(rtype, "ADDED", obj, None)
        return _with_warnings(render(stored, rtype.api_version), warnings)

    def update(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        body: Obj,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        precondition_rv: str | None = None,
        strict: bool = False,
        managed: Managed | None = None,
    ) -> Obj:
        old = self.find(rtype, namespace, name)
        if old is None:
            raise errors.not_found(rtype.plural, rtype.group, name)
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        self._check_kind(rtype, body)
        new_meta = body.get("metadata") or {}
        if new_meta.get("name", name) != name:
            raise errors.bad_request("the name of the object does not match the name on the URL")
        wanted_rv = precondition_rv or new_meta.get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise errors.conflict(rtype.plural, rtype.group, name)
        strategy = strategy_for(rtype)
        obj = self._merge_update(rtype, old, json_copy(body), subresource)
        warnings = strategy.prepare_update(rtype, obj, old, subresource, self, strict)
        self._validate(rtype, strategy, obj, old)
        old_finalizers = old["metadata"].get("finalizers") or []
        new_finalizers = obj["metadata"].get("finalizers") or []
        if old["metadata"].get("deletionTimestamp") and set(new_finalizers) - set(old_finalizers):
            raise errors.invalid(
                rtype.kind,
                rtype.group,
                name,
                [
                    (
                        "FieldValueForbidden",
                        "metadata.finalizers",
                        "metadata.finalizers: Forbidden: no new finalizers can be added if the "
                        "object is being deleted",
                    )
                ],
            )
        _record(managed, old, obj)
        if _same(obj, old):
            return render(old, rtype.api_version)
        if dry_run:
            return render(obj, rtype.api_version)
        if should_delete_during_update(obj) and not strategy.holds_deletion(obj):
            stored = self._commit(rtype, "DELETED", obj, old)
        else:
            stored = self._commit(rtype, "MODIFIED", obj, old)
        return _with_warnings(render(stored, rtype.api_version), warnings)

    def _merge_update(
        self, rtype: ResourceType, old: Obj, new: Obj, subresource: str | None
    ) -> Obj:
        if subresource == "status":
            obj = {k: json_copy(v) for k, v in old.items() if k != "status"}
            obj["status"] = new.get("status")
            if obj["status"] is None:
                obj.pop("status")
            return obj
        obj = new
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        meta = obj.setdefault("metadata", {})
        old_meta = old["metadata"]
        for kept in (
            "uid",
            "creationTimestamp",
            "name",
            "namespace",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generateName",
        ):
            if kept in old_meta:
                meta[kept] = old_meta[kept]
            else:
                meta.pop(kept, None)
        # A request's own managedFields are kept as given (kubectl rewrites them when it moves
        # an object from client-side to server-side apply); without them the old ones stay.
        # The field manager (apply.py) then records the write on top of them.
        if not meta.get("managedFields") and "managedFields" in old_meta:
            meta["managedFields"] = old_meta["managedFields"]
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if rtype.has_status:
            if "status" in old:
                obj["status"] = old["status"]
            else:
                obj.pop("status", None)
        ignored = ("metadata", "status") if rtype.has_status else ("metadata",)
        changed = any(obj.get(k) != old.get(k) for k in set(obj) | set(old) if k not in ignored)
        meta["generation"] = old_meta.get("generation", 1) + (1 if changed else 0)
        return obj

    def delete(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        options: Obj | None = None,
        *,
        dry_run: bool = False,
    ) -> Obj:
        options = options or {}
        old = self.find(rtype, namespace, name)
        if old is None:
            raise errors.not_found(rtype.plural, rtype.group, name)
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != old["metadata"]["uid"]:
            raise errors.conflict(
                rtype.plural,
                rtype.group,
                name,
                f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                f"UID in object meta: {old['metadata']['uid']}",
            )
        if (
            preconditions.get("resourceVersion")
            and preconditions["resourceVersion"] != old["metadata"]["resourceVersion"]
        ):
            raise errors.conflict(
                rtype.plural,
                rtype.group,
                name,
                "Precondition failed: ResourceVersion in precondition: "
                f"{preconditions['resourceVersion']}, ResourceVersion in object meta: "
                f"{old['metadata']['resourceVersion']}",
            )
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy not in (None, "Orphan", "Foreground", "Background"):
            raise errors.bad_request(f"propagationPolicy {policy!r} is not supported")
        strategy = strategy_for(rtype)
        obj = json_copy(old)
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        for wanted, marker in (("Foreground", "foregroundDeletion"), ("Orphan", "orphan")):
            if policy == wanted and marker not in finalizers:
                finalizers.append(marker)
        grace = strategy.grace_period(obj, options)
        if meta.get("deletionTimestamp"):
            # Already being deleted: a shorter grace period may still cut the wait short.
            current = meta.get("deletionGracePeriodSeconds")
            if grace == 0 and not finalizers and not strategy.holds_deletion(obj):
                return self._remove(rtype, obj, old, dry_run)
            if grace is not None and current is not None and grace < current:
                meta["deletionGracePeriodSeconds"] = grace
                meta["deletionTimestamp"] = now_iso(grace)
            else:
                return render(old, rtype.api_version)
        else:
            if grace:
                meta["deletionGracePeriodSeconds"] = grace
                meta["deletionTimestamp"] = now_iso(grace)
            elif finalizers or strategy.holds_deletion(obj):
                meta["deletionGracePeriodSeconds"] = 0
                meta["deletionTimestamp"] = now_iso()
            else:
                return self._remove(rtype, obj, old, dry_run)
            meta["generation"] = meta.get("generation", 1) + 1
        if finalizers:
            meta["finalizers"] = finalizers
        strategy.prepare_delete(rtype, obj)
        if dry_run:
            return render(obj, rtype.api_version)
        return render(self._commit(rtype, "MODIFIED", obj, old), rtype.api_version)

    def _remove(self, rtype: ResourceType, obj: Obj, old: Obj, dry_run: bool) -> Obj:
        if dry_run:
            return render(obj, rtype.api_version)
        return render(self._commit(rtype, "DELETED", obj, old), rtype.api_version)

    def remove_now(self, rtype: ResourceType, namespace: str, name: str) -> None:
        """Drop an object regardless of finalizers (a CRD's instances when it goes away)."""
        old = self.find(rtype, namespace, name)
        if old is not None:
            self._commit(rtype, "DELETED", old, old)

    # ----------------------------------------------------------------- checks
    def _check_kind(self, rtype: ResourceType, obj: Obj) -> None:
        kind = obj.get("kind")
        if kind and kind != rtype.kind:
            raise errors.bad_request(
                f"the kind {kind!r} does not match the resource {rtype.plural!r}"
            )
        api_version = obj.get("apiVersion")
        if (
            api_version
            and api_version.split("/")[0] != rtype.api_version.split("/")[0]
            and rtype.group
        ):
            raise errors.bad_request(
                f"the apiVersion {api_version!r} does not match {rtype.api_version!r}"
            )

    def _check_quota(self, rtype: ResourceType, namespace: str, name: str) -> None:
        """ResourceQuota admission for the one quota enforced here, the count of pods
        (``spec.hard.pods`` or ``count/pods``; pods that ended do not count), answered as
        the real API server does: 403 Forbidden, "exceeded quota"."""
        if rtype.storage_key != "pods":
            return
        quotas = self.objects_in("resourcequotas", namespace)
        if not quotas:
            return
        used = sum(
            1
            for pod in self.objects_in("pods", namespace)
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )
        for quota in quotas:
            hard = (quota.get("spec") or {}).get("hard") or {}
            for key in ("pods", "count/pods"):
                if key in hard and used + 1 > int(hard[key]):
                    raise errors.ApiError(
                        403,
                        "Forbidden",
                        f'pods "{name}" is forbidden: exceeded quota: '
                        f"{quota['metadata']['name']}, requested: {key}=1, used: "
                        f"{key}={used}, limited: {key}={hard[key]}",
                    )

    def _check_namespace(self, namespace: str) -> None:
        ns_type = self.registry.get("", "v1", "namespaces")
        assert ns_type is not None
        ns = self.find(ns_type, "", namespace)
        if ns is None:
            raise errors.not_found("namespaces", "", namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise errors.ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being "
                "terminated",
            )

    def _validate(
        self, rtype: ResourceType, strategy: Strategy, obj: Obj, old: Obj | None = None
    ) -> None:
        causes = strategy.validate(rtype, obj, old)
        if causes:
            raise errors.invalid(rtype.kind, rtype.group, obj["metadata"].get("name", ""), causes)


def should_delete_during_update(obj: Obj) -> bool:
    """An update removes an object that is being deleted, has no finalizers left and no grace
    period to wait out (a terminating pod stays until its kubelet deletes it with grace 0)."""
    meta = obj["metadata"]
    return (
        bool(meta.get("deletionTimestamp"))
        and not meta.get("finalizers")
        and not meta.get("deletionGracePeriodSeconds")
    )


def _record(managed: Managed | None, old: Obj | None, obj: Obj) -> None:
    """Set the write's ``managedFields`` (writes without a manager keep the old ones)."""
    if managed is None:
        return
    entries = managed(old, obj)
    if entries:
        obj["metadata"]["managedFields"] = entries
    else:
        obj["metadata"].pop("managedFields", None)


def _same(a: Obj, b: Obj) -> bool:
    def strip(obj: Obj) -> Obj:
        meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
        return {**obj, "metadata": meta}

    return strip(a) == strip(b)


def _with_warnings(obj: Obj, warnings: list[str] | None) -> Obj:
    """Carry ``Warning`` headers (pruned unknown fields) to the HTTP layer, which pops them."""
    if warnings:
        return {**obj, "__warnings__": warnings}
    return obj

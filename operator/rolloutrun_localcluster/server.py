"""The HTTP face of the emulator: Kubernetes REST paths, verbs, content types and errors.

It parses ``/api/v1/...`` and ``/apis/<group>/<version>/...`` paths itself (the resource
set changes as CRDs come and go), admits each request (authentication, impersonation and
RBAC in :mod:`.access`), and maps each verb onto the
store: GET (get, list, watch, pod logs), POST (create, eviction), PUT (update),
PATCH (merge, JSON, strategic merge), DELETE (delete, deletecollection). Every error is a
``Status`` with the real code and reason. It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from aiohttp import web

from . import apply, disruption, errors, openapi, openapi_v2, patches, protobuf, resources
from .access import Access
from .errors import ApiError
from .rbac import RBAC_GROUP
from .resources import Registry, ResourceType
from .selectors import parse_field_selector, parse_label_selector
from .store import Store, now_iso
from .tables import as_table, wants_table
from .watch import WatchHub

logger = logging.getLogger(__name__)

# Kinds whose registry returns the deleted object (``ReturnDeletedObject``) instead of a Status.
RETURN_DELETED = frozenset(
    {"pods", "services", "serviceaccounts", "namespaces", "customresourcedefinitions"}
)


class LogSource(Protocol):
    """What the kubelet offers the ``pods/log`` endpoint."""

    async def read_log(
        self, namespace: str, name: str, container: str | None, query: dict[str, str]
    ) -> bytes: ...

    async def follow_log(
        self,
        namespace: str,
        name: str,
        container: str | None,
        query: dict[str, str],
        write: Callable[[bytes], Awaitable[None]],
    ) -> None: ...


@dataclass
class Target:
    rtype: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def _json(body: Any, status: int = 200, warnings: list[str] | None = None) -> web.Response:
    headers = {}
    if warnings:
        headers["Warning"] = ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings)
    return web.Response(
        body=json.dumps(body).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _error(error: ApiError) -> web.Response:
    response = _json(error.status(), error.code)
    retry_after = (error.details or {}).get("retryAfterSeconds")
    if retry_after:  # a 429 says when to come back, in the body and the header
        response.headers["Retry-After"] = str(retry_after)
    return response


def _pop_warnings(obj: dict[str, Any]) -> list[str]:
    return obj.pop("__warnings__", None) or []


class ApiServer:
    """The aiohttp application of the emulator."""

    def __init__(
        self, store: Store, registry: Registry, token: str, logs: LogSource | None = None
    ) -> None:
        self.store = store
        self.registry = registry
        self.token = token
        self.access = Access(store, registry, token)
        self.logs = logs
        self.watches = WatchHub(store)
        self.requests: Counter[tuple[str, str, str]] = Counter()
        """Admitted requests by (user, verb, resource): what a benchmark counts the load of a
        client by (a watch counts once, when it is opened)."""
        self.watch_selectors: Counter[tuple[str, str, str]] = Counter()
        """Watches opened, by (user, resource, labelSelector)."""
        self.address = "127.0.0.1:0"
        self.app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self._dispatch)

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            attributes = self.access.admit(
                request.method,
                request.path,
                request.query,
                request.headers,
                request.headers.getall("Impersonate-Group", []),
            )
            self.requests[(attributes.user.name, attributes.verb, attributes.resource)] += 1
            if attributes.verb == "watch":
                selector = request.query.get("labelSelector", "")
                self.watch_selectors[(attributes.user.name, attributes.resource, selector)] += 1
            if self.access.computed(attributes):
                return _json(*self.access.answer(attributes, await self._body(request)))
            if attributes.api_group == RBAC_GROUP:
                self.access.check_escalation(attributes, await self._body(request))
            return await handler(request)
        except ApiError as error:
            return _error(error)
        except json.JSONDecodeError as error:
            return _error(
                errors.bad_request(f"couldn't get version/kind; json parse error: {error}")
            )

    # ------------------------------------------------------------------ routing
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/version":
            return _json(resources.VERSION_INFO)
        if path == "/api":
            return _json(resources.core_versions(self.address))
        if path == "/apis":
            return _json(resources.api_group_list(self.registry))
        if path == "/openapi/v2":
            body, content_type = openapi_v2.render(self.registry, request.headers.get("Accept", ""))
            return web.Response(body=body, headers={"Content-Type": content_type})
        if path == "/openapi/v3":
            return _json(openapi.root(self.registry))
        if path.startswith("/openapi/v3/"):
            document = openapi.group_version(self.registry, path[len("/openapi/v3/") :])
            if document is None:
                raise errors.path_not_found(path)
            return _json(document)
        segments = [s for s in path.split("/") if s]
        if len(segments) >= 2 and segments[0] == "api":
            group, version, rest = "", segments[1], segments[2:]
        elif len(segments) >= 2 and segments[0] == "apis":
            group = segments[1]
            if len(segments) == 2:
                versions = self.registry.group_versions().get(group)
                if not versions:
                    raise errors.path_not_found(path)
                return _json(resources.api_group(group, versions))
            version, rest = segments[2], segments[3:]
        else:
            raise errors.path_not_found(path)
        if not rest:
            listing = resources.resource_list(self.registry, group, version)
            if listing is None:
                raise errors.path_not_found(path)
            return _json(listing)
        target = self._target(group, version, rest, path)
        return await self._verb(request, target)

    def _target(self, group: str, version: str, rest: list[str], path: str) -> Target:
        if rest[0] == "namespaces" and len(rest) >= 3:
            rtype = self.registry.get(group, version, rest[2])
            if rtype is not None and rtype.namespaced and len(rest) <= 5:
                return Target(
                    rtype,
                    rest[1],
                    rest[3] if len(rest) > 3 else None,
                    rest[4] if len(rest) > 4 else None,
                )
        rtype = self.registry.get(group, version, rest[0])
        if rtype is None or len(rest) > 3:
            raise errors.path_not_found(path)
        name = rest[1] if len(rest) > 1 else None
        if rtype.namespaced and name is not None:
            raise errors.path_not_found(path)
        return Target(rtype, None, name, rest[2] if len(rest) > 2 else None)

    async def _verb(self, request: web.Request, target: Target) -> web.StreamResponse:
        method = request.method
        if target.subresource is not None and target.subresource not in target.rtype.subresources:
            raise errors.path_not_found(request.path)
        if target.name is None:
            if method == "GET":
                return await self._get_collection(request, target)
            if method == "POST":
                return await self._create(request, target)
            if method == "DELETE":
                return await self._delete_collection(request, target)
            raise errors.method_not_allowed()
        if target.subresource == "log" and method == "GET":
            return await self._log(request, target)
        if target.subresource == "eviction" and method == "POST":
            return await self._evict(request, target)
        if method == "GET":
            obj = self.store.get(target.rtype, target.namespace or "", target.name)
            if target.subresource is None and wants_table(request.headers.get("Accept", "")):
                meta = {"resourceVersion": obj["metadata"]["resourceVersion"]}
                include = request.query.get("includeObject")
                return _json(as_table(target.rtype, [obj], meta, include))
            return _json(obj)
        if method == "PUT":
            return await self._update(request, target)
        if method == "PATCH":
            return await self._patch(request, target)
        if method == "DELETE" and target.subresource is None:
            return await self._delete(request, target)
        raise errors.method_not_allowed()

    # ------------------------------------------------------------------ verbs
    async def _get_collection(self, request: web.Request, target: Target) -> web.StreamResponse:
        query = request.query
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), target.rtype.plural)
        if query.get("watch") in ("true", "1"):
            return await self.watches.serve(request, target.rtype, target.namespace, labels, fields)
        items = self.store.list_objects(target.rtype, target.namespace, labels, fields)
        rv = str(self.store.resource_version)
        meta: dict[str, Any] = {"resourceVersion": rv}
        if query.get("continue"):
            try:
                token = json.loads(base64.b64decode(query["continue"]))
                after, rv = tuple(token["after"]), token["rv"]
            except (ValueError, KeyError, TypeError) as error:
                raise errors.bad_request(f"continue key is not valid: {error}") from error
            items = [
                i
                for i in items
                if (i["metadata"].get("namespace", ""), i["metadata"]["name"]) > after
            ]
            meta["resourceVersion"] = rv
        limit = int(query.get("limit") or 0)
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            token = {"after": [last.get("namespace", ""), last["name"]], "rv": rv}
            meta["continue"] = base64.b64encode(json.dumps(token).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        if wants_table(request.headers.get("Accept", "")):
            return _json(as_table(target.rtype, items, meta, query.get("includeObject")))
        body = {
            "kind": f"{target.rtype.kind}List",
            "apiVersion": target.rtype.api_version,
            "metadata": meta,
            "items": items,
        }
        return _json(body)

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        content_type = request.headers.get("Content-Type", "application/json").split(";")[0].strip()
        if content_type in ("application/yaml", "application/apply-patch+yaml"):
            from rolloutrun_runtime.contract.kube_yaml import load_yaml

            return load_yaml(raw)
        if content_type == protobuf.MEDIA_TYPE:
            return protobuf.request_body(raw)
        return json.loads(raw)

    @staticmethod
    def _flags(request: web.Request) -> dict[str, Any]:
        return {
            "dry_run": request.query.get("dryRun") == "All",
            "strict": request.query.get("fieldValidation") == "Strict",
        }

    @staticmethod
    def _managed(request: web.Request, target: Target, is_apply: bool = False) -> apply.Recorder:
        """The field manager of a write (managedFields, see apply.py)."""
        field_manager = request.query.get("fieldManager")
        apply.check_manager(field_manager, is_apply, request.query.get("force") == "true")
        manager = apply.manager_name(field_manager, request.headers.get("User-Agent", ""))
        return apply.recorder(target.rtype, manager, target.subresource, now_iso)

    async def _create(self, request: web.Request, target: Target) -> web.Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        created = self.store.create(
            target.rtype,
            target.namespace or "",
            body,
            managed=self._managed(request, target),
            **self._flags(request),
        )
        warnings = _pop_warnings(created)
        return _json(created, 201, warnings)

    async def _update(self, request: web.Request, target: Target) -> web.Response:
        assert target.name is not None
        body = await self._body(request)
        updated = self.store.update(
            target.rtype,
            target.namespace or "",
            target.name,
            body,
            subresource=target.subresource,
            managed=self._managed(request, target),
            **self._flags(request),
        )
        return _json(updated, 200, _pop_warnings(updated))

    async def _patch(self, request: web.Request, target: Target) -> web.Response:
        assert target.name is not None
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        patch = await self._body(request)
        if content_type == "application/apply-patch+yaml":
            return self._apply(request, target, patch)
        managed = self._managed(request, target)
        current = self.store.get(target.rtype, target.namespace or "", target.name)
        if content_type == "application/merge-patch+json":
            new = patches.merge_patch(current, patch)
        elif content_type == "application/json-patch+json":
            new = patches.json_patch(current, patch)
        elif content_type == "application/strategic-merge-patch+json":
            if target.rtype.custom:
                raise errors.unsupported_media_type(content_type)
            new = patches.strategic_merge_patch(current, patch)
        else:
            raise errors.unsupported_media_type(content_type)
        updated = self.store.update(
            target.rtype,
            target.namespace or "",
            target.name,
            new,
            subresource=target.subresource,
            managed=managed,
            **self._flags(request),
        )
        return _json(updated, 200, _pop_warnings(updated))

    def _apply(self, request: web.Request, target: Target, config: Any) -> web.Response:
        """Server-side apply: create or merge, with field ownership (apply.py)."""
        assert target.name is not None
        field_manager = request.query.get("fieldManager")
        force = request.query.get("force") == "true"
        apply.check_manager(field_manager, True, force)
        options = apply.ApplyRequest(field_manager or "", force, target.subresource, now_iso())
        result, code = apply.serve_apply(
            self.store,
            target.rtype,
            target.namespace or "",
            target.name,
            config,
            options,
            self._flags(request),
        )
        return _json(result, code, _pop_warnings(result))

    async def _delete_options(self, request: web.Request) -> dict[str, Any]:
        options = await self._body(request) or {}
        for key in ("gracePeriodSeconds", "propagationPolicy", "orphanDependents"):
            if key in request.query:
                value: Any = request.query[key]
                if key == "gracePeriodSeconds":
                    value = int(value)
                elif key == "orphanDependents":
                    value = value == "true"
                options[key] = value
        return options

    async def _delete(self, request: web.Request, target: Target) -> web.Response:
        assert target.name is not None
        options = await self._delete_options(request)
        dry_run = request.query.get("dryRun") == "All" or options.get("dryRun") == ["All"]
        deleted = self.store.delete(
            target.rtype, target.namespace or "", target.name, options, dry_run=dry_run
        )
        still_there = self.store.find(target.rtype, target.namespace or "", target.name)
        if still_there is not None or target.rtype.custom or target.rtype.plural in RETURN_DELETED:
            return _json(deleted)
        # Most built-in kinds answer an immediate deletion with a Status, not the object.
        details = {
            "name": target.name,
            "group": target.rtype.group,
            "kind": target.rtype.plural,
            "uid": deleted["metadata"]["uid"],
        }
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        return _json({**status, "details": details})

    async def _delete_collection(self, request: web.Request, target: Target) -> web.Response:
        options = await self._delete_options(request)
        labels = parse_label_selector(request.query.get("labelSelector"))
        fields = parse_field_selector(request.query.get("fieldSelector"), target.rtype.plural)
        items = []
        for obj in self.store.list_objects(target.rtype, target.namespace, labels, fields):
            meta = obj["metadata"]
            try:
                items.append(
                    self.store.delete(
                        target.rtype, meta.get("namespace", ""), meta["name"], options
                    )
                )
            except ApiError as error:
                if error.code != 404:
                    raise
        body = {
            "kind": f"{target.rtype.kind}List",
            "apiVersion": target.rtype.api_version,
            "metadata": {"resourceVersion": str(self.store.resource_version)},
            "items": items,
        }
        return _json(body)

    async def _evict(self, request: web.Request, target: Target) -> web.Response:
        assert target.name is not None
        body = await self._body(request) or {}
        options = body.get("deleteOptions") or {}
        namespace = target.namespace or ""
        pod = self.store.get(target.rtype, namespace, target.name)
        budgets = self.registry.get("policy", "v1", "poddisruptionbudgets")
        verdict = disruption.evict(
            pod,
            self.store.objects(disruption.STORAGE_KEY) if budgets else (),
            datetime.now(UTC),
        )
        dry_run = request.query.get("dryRun") == "All" or options.get("dryRun") == ["All"]
        if verdict.budget is not None and budgets is not None and not dry_run:
            meta = verdict.budget["metadata"]
            self.store.update(
                budgets,
                namespace,
                meta["name"],
                {**verdict.budget, "status": verdict.status},
                subresource="status",
                precondition_rv=meta["resourceVersion"],
            )
        if not dry_run and disruption.preconditions_hold(pod, options):
            stored = self.store.update(
                target.rtype,
                namespace,
                target.name,
                {**pod, "status": disruption.evicting_status(pod, datetime.now(UTC))},
                subresource="status",
                precondition_rv=pod["metadata"]["resourceVersion"],
            )
            options = disruption.after_own_write(options, stored)
        self.store.delete(target.rtype, namespace, target.name, options, dry_run=dry_run)
        return _json(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "code": 201,
            },
            201,
        )

    async def _log(self, request: web.Request, target: Target) -> web.StreamResponse:
        assert target.name is not None
        namespace = target.namespace or ""
        self.store.get(target.rtype, namespace, target.name)
        if self.logs is None:
            raise errors.bad_request(f'pod "{target.name}" has no kubelet to serve its logs')
        query = dict(request.query)
        container = query.get("container")
        if query.get("follow") not in ("true", "1"):
            data = await self.logs.read_log(namespace, target.name, container, query)
            return web.Response(body=data, content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            await self.logs.follow_log(namespace, target.name, container, query, response.write)
        except ConnectionResetError:
            logger.debug("log follower of %s/%s went away", namespace, target.name)
        return response

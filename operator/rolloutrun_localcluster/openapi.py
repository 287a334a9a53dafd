"""Just enough OpenAPI v3 for kubectl: one PATCH operation per resource, tagged with its
group-version-kind and the ``fieldValidation`` query parameter.

kubectl (1.27+) checks the server's OpenAPI v3 document for a ``fieldValidation`` parameter
before it sends ``apply``/``create`` with server-side validation; finding it, it sends
``fieldValidation=Strict`` and the server validates. Without it kubectl would fall back to
client-side validation, which needs the full schemas. ``kubectl explain`` is not supported.

``definitions`` is the one list of schemas both documents carry (v3 ``components.schemas``,
v2 ``definitions`` in openapi_v2.py): each kind under its real definition name, tagged with
``x-kubernetes-group-version-kind``; custom resources with their CRD's schema, built-in kinds
as plain objects (their full schemas are compiled into the clients).
"""

from __future__ import annotations

from typing import Any

from .resources import Registry, ResourceType


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def root(registry: Registry) -> dict[str, Any]:
    """``/openapi/v3``: the group versions and where their documents are."""
    versions = {(t.group, t.version) for t in registry.all()}
    paths = {
        _gv_path(g, v): {"serverRelativeURL": f"/openapi/v3/{_gv_path(g, v)}?hash=local"}
        for g, v in sorted(versions)
    }
    return {"paths": paths}


# Definition name prefixes of the built-in groups (``io.k8s.api.core.v1.Pod``).
_BUILTIN_PREFIX = {
    "": "io.k8s.api.core",
    "apiextensions.k8s.io": "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions",
}


def definition_name(rtype: ResourceType) -> str:
    """``io.k8s.api.apps.v1.Deployment``; custom kinds by reversed group
    (``dev.rolloutrun.v1alpha1.RolloutRun``), as the real server names them."""
    if rtype.custom:
        prefix = ".".join(reversed(rtype.group.split(".")))
    elif rtype.group in _BUILTIN_PREFIX:
        prefix = _BUILTIN_PREFIX[rtype.group]
    else:
        prefix = "io.k8s.api." + rtype.group.split(".")[0]
    return f"{prefix}.{rtype.version}.{rtype.kind}"


def definitions(types: list[ResourceType]) -> dict[str, Any]:
    """The schema of each kind, keyed by definition name."""
    result: dict[str, Any] = {}
    for rtype in sorted(types, key=definition_name):
        schema: dict[str, Any] = dict(rtype.schema or {"type": "object"})
        schema["x-kubernetes-group-version-kind"] = [
            {"group": rtype.group, "kind": rtype.kind, "version": rtype.version}
        ]
        result[definition_name(rtype)] = schema
    return result


def _object_path(rtype: ResourceType) -> str:
    prefix = "/" + _gv_path(rtype.group, rtype.version)
    if rtype.namespaced:
        return f"{prefix}/namespaces/{{namespace}}/{rtype.plural}/{{name}}"
    return f"{prefix}/{rtype.plural}/{{name}}"


def group_version(registry: Registry, path: str) -> dict[str, Any] | None:
    """``/openapi/v3/api/v1`` or ``/openapi/v3/apis/<group>/<version>``."""
    types = [t for t in registry.all() if _gv_path(t.group, t.version) == path]
    if not types:
        return None
    paths: dict[str, Any] = {}
    for rtype in types:
        gvk = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}
        parameters = [
            {"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
            for name in ("dryRun", "fieldManager", "fieldValidation", "force")
        ]
        operation = {
            "operationId": f"patch{rtype.kind}",
            "parameters": parameters,
            "responses": {"200": {"description": "OK"}},
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": gvk,
        }
        paths[_object_path(rtype)] = {"patch": operation}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (rolloutrun local cluster)", "version": "v1.32.0"},
        "paths": paths,
        "components": {"schemas": definitions(types)},
    }

"""The three patch formats the API server accepts, as pure functions over JSON values.

- JSON merge patch (RFC 7386, ``application/merge-patch+json``): what Kopf sends.
- JSON patch (RFC 6902, ``application/json-patch+json``): Kopf sends a ``test`` op first;
  a failed ``test`` or a missing path is a 422 from the real server, and here.
- Strategic merge patch (``application/strategic-merge-patch+json``): kubectl's default for
  built-in kinds; lists with a merge key (containers by ``name``, conditions by ``type``...)
  merge element-wise, the ``$patch``/``$deleteFromPrimitiveList``/``$setElementOrder``/
  ``$retainKeys`` directives apply. Custom resources refuse it with a 415, as real.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError, bad_request, unprocessable


def json_copy(value: Any) -> Any:
    """A deep copy of a JSON value (dicts, lists, scalars): what ``copy.deepcopy`` does for
    these, several times faster (no memo: JSON values share nothing and hold no cycles).
    Every write copies its body; a Lease renewal spent most of its time in deepcopy."""
    if isinstance(value, dict):
        return {key: json_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_copy(item) for item in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return copy.deepcopy(value)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return json_copy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise unprocessable(f"JSON pointer {path!r} must start with '/'")
    return [_unescape(token) for token in path[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if token == "-" and for_add:
        return len(container)
    if not token.isdigit():
        raise unprocessable(f"invalid array index {token!r}")
    index = int(token)
    limit = len(container) if for_add else len(container) - 1
    if index > limit:
        raise unprocessable(f"array index {index} out of bounds")
    return index


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    current = doc
    for token in tokens[:-1]:
        if isinstance(current, dict) and token in current:
            current = current[token]
        elif isinstance(current, list):
            current = current[_index(current, token, for_add=False)]
        else:
            raise unprocessable(f"doc is missing path: {path!r}: missing value")
    return current


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise unprocessable(f"doc is missing path: {path!r}: missing value")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, for_add=False)]
    raise unprocessable(f"doc is missing path: {path!r}: missing value")


def _remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        raise unprocessable("cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise unprocessable(f"Unable to remove nonexistent key: {last}: missing value")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, for_add=False))
    raise unprocessable(f"doc is missing path: {path!r}: missing value")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, for_add=True), value)
    else:
        raise unprocessable(f"doc is missing path: {path!r}: missing value")
    return doc


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902 over a deep copy of ``doc``; any failure is a 422 and nothing applies."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    result = json_copy(doc)
    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation:
            raise bad_request(f"invalid JSON patch operation: {operation!r}")
        op, path = operation["op"], operation.get("path", "")
        if op == "add":
            result = _add(result, path, json_copy(operation.get("value")))
        elif op == "remove":
            _remove(result, path)
        elif op == "replace":
            _get(result, path)
            tokens = _pointer(path)
            if not tokens:
                result = json_copy(operation.get("value"))
            else:
                parent = _parent(result, tokens, path)
                key: Any = tokens[-1]
                if isinstance(parent, list):
                    key = _index(parent, tokens[-1], for_add=False)
                parent[key] = json_copy(operation.get("value"))
        elif op == "move":
            value = _remove(result, operation["from"])
            result = _add(result, path, value)
        elif op == "copy":
            result = _add(result, path, json_copy(_get(result, operation["from"])))
        elif op == "test":
            if _get(result, path) != operation.get("value"):
                raise unprocessable(
                    "the server rejected our request due to an error in our request: "
                    f"testing value {path} failed: test failed"
                )
        else:
            raise unprocessable(f"Unexpected kind: {op}")
    return result


# Merge keys of built-in lists (the ``patchMergeKey`` tags of the Go types), by field name.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "podIPs": "ip",
    "readinessGates": "conditionType",
    "resourceClaims": "name",
}
# Primitive lists with ``patchStrategy: merge`` (union instead of replace).
MERGE_PRIMITIVE_LISTS = frozenset({"finalizers"})


def _ports_key(items: list[Any]) -> str:
    # Container ports merge on containerPort, Service ports on port.
    sample = next((item for item in items if isinstance(item, dict)), {})
    return "containerPort" if "containerPort" in sample else "port"


def _merge_key(field: str, *lists: list[Any]) -> str | None:
    if field == "ports":
        return _ports_key([item for items in lists for item in items])
    return MERGE_KEYS.get(field)


def strategic_merge_patch(original: Any, patch: Any) -> Any:
    """Apply a strategic merge patch to a built-in object (``original`` is not modified)."""
    if not isinstance(patch, dict):
        raise bad_request("strategic merge patch must be a JSON object")
    return _smp_map(original if isinstance(original, dict) else {}, patch)


def _smp_map(original: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: json_copy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return {}
    # Shallow: a key the patch touches gets a new value (a merged map is a new dict); the
    # values it leaves are shared with ``original``, as in merge_patch (the store copies
    # what it stores).
    result = dict(original)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$setElementOrder/"):
            continue  # ordering hints only; element order is kept as merged
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [item for item in result[field] if item not in (value or [])]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            base = result.get(key)
            result[key] = _smp_map(base if isinstance(base, dict) else {}, value)
        elif isinstance(value, list):
            base = result.get(key)
            result[key] = _smp_list(key, base if isinstance(base, list) else [], value)
        else:
            result[key] = json_copy(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(field: str, original: list[Any], patch: list[Any]) -> list[Any]:
    if field in MERGE_PRIMITIVE_LISTS:
        merged = list(original)
        merged.extend(item for item in patch if item not in merged)
        return merged
    key = _merge_key(field, original, patch)
    if key is None:
        if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
            return [item for item in patch if not (isinstance(item, dict) and "$patch" in item)]
        return json_copy(patch)
    result = json_copy(original)
    for item in patch:
        if not isinstance(item, dict):
            raise ApiError(
                400, "BadRequest", f"strategic merge patch: {field} items must be objects"
            )
        if item.get("$patch") == "replace":
            return [i for i in patch if not (isinstance(i, dict) and i.get("$patch"))]
        if key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {key}")
        index = next(
            (
                i
                for i, existing in enumerate(result)
                if isinstance(existing, dict) and existing.get(key) == item[key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
            continue
        if index is None:
            result.append({k: v for k, v in item.items() if v is not None})
        else:
            result[index] = _smp_map(result[index], item)
    return result

"""Field sets and ``metadata.managedFields``, as the real API server's field manager keeps them.

Every write records who set which fields: an ``Apply`` entry per server-side-apply manager
(the fields of its last applied configuration) and an ``Update`` entry per manager of other
writes (the fields it changed). Server-side apply reads these sets to find conflicts and to
remove what a manager stopped applying; ``kubectl get -o yaml --show-managed-fields`` shows
them. A path is a tuple of FieldsV1 elements, spelled as the real server spells them:
``f:<field>``, ``k:{"name":"x"}`` (an item of a list keyed by merge keys), ``v:"x"`` (an item
of a set-like list). Lists merge by their keys: built-in kinds by the ``patchMergeKey`` tags
patches.py knows, custom resources by ``x-kubernetes-list-type``/``-list-map-keys``; other
lists, and maps marked atomic, are owned whole.

Pure functions over JSON values; the HTTP and store sides live in apply.py and server.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .patches import MERGE_KEYS, MERGE_PRIMITIVE_LISTS

Path = tuple[str, ...]
FieldSet = frozenset[Path]
Obj = dict[str, Any]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

# Metadata the field manager never tracks (``stripMeta`` of the real server).
STRIPPED_META = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
    "managedFields",
)
# Built-in maps of arbitrary keys (granular maps): their own entry shows as ``.`` in Update sets.
GRANULAR_MAPS = frozenset(
    {
        "labels",
        "annotations",
        "data",
        "binaryData",
        "stringData",
        "nodeSelector",
        "limits",
        "requests",
        "matchLabels",
        "hard",
    }
)
# Keyed built-in lists with more than one key (the ``listMapKeys`` of the Go types).
MULTI_KEYS: dict[str, tuple[str, ...]] = {"ports": ("port", "protocol")}
CONTAINER_PORT_KEYS = ("containerPort", "protocol")
KEY_DEFAULTS: dict[str, Any] = {"protocol": "TCP"}


@dataclass(frozen=True)
class Shape:
    """What the field manager needs to know of a value's type: how its lists merge and
    whether its maps are atomic. ``schema`` is the CRD's structural schema node (``None``:
    built-in or schemaless), ``field`` the name the value sits under."""

    field: str = ""
    schema: dict[str, Any] | None = None
    custom: bool = False
    root: bool = False

    def child(self, key: str) -> Shape:
        if self.root and key == "metadata":
            return Shape("metadata")
        if not self.custom:
            return Shape(key)
        sub: dict[str, Any] | None = None
        if self.schema is not None:
            properties = self.schema.get("properties") or {}
            additional = self.schema.get("additionalProperties")
            if key in properties:
                sub = properties[key]
            elif isinstance(additional, dict):
                sub = additional
        return Shape(key, sub, custom=True)

    def item(self) -> Shape:
        if not self.custom:
            return Shape("")
        items = (self.schema or {}).get("items")
        return Shape("", items if isinstance(items, dict) else None, custom=True)

    def list_keys(self, items: list[Any]) -> tuple[str, ...] | None:
        """``()`` for a set, the key fields for a keyed list, ``None`` for an atomic list."""
        if self.custom:
            schema = self.schema or {}
            kind = schema.get("x-kubernetes-list-type")
            if kind == "map":
                return tuple(schema.get("x-kubernetes-list-map-keys") or ())
            return () if kind == "set" else None
        if self.field in MERGE_PRIMITIVE_LISTS:
            return ()
        if self.field == "ports":
            sample = next((i for i in items if isinstance(i, dict)), {})
            return CONTAINER_PORT_KEYS if "containerPort" in sample else MULTI_KEYS["ports"]
        key = MERGE_KEYS.get(self.field)
        return (key,) if key else None

    def atomic_map(self, value: Obj) -> bool:
        if self.custom:
            return (self.schema or {}).get("x-kubernetes-map-type") == "atomic"
        # LabelSelector is an atomic struct (``f:selector: {}``); Service selectors are maps.
        return self.field == "selector" and bool({"matchLabels", "matchExpressions"} & set(value))

    def granular(self) -> bool:
        if self.custom:
            return isinstance((self.schema or {}).get("additionalProperties"), dict)
        return self.field in GRANULAR_MAPS


def root_shape(schema: dict[str, Any] | None, custom: bool) -> Shape:
    return Shape("", schema, custom=custom, root=True)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def key_element(item: Any, keys: tuple[str, ...], field: str) -> str:
    """The ``k:{...}`` element of a keyed list item (key fields sorted, as the server)."""
    if not isinstance(item, dict):
        raise bad_request(f"{field}: list items must be objects with the merge key {keys[0]}")
    values: dict[str, Any] = {}
    for key in keys:
        if key in item:
            values[key] = item[key]
        elif key in KEY_DEFAULTS:
            values[key] = KEY_DEFAULTS[key]
        else:
            raise bad_request(
                f"failed to create typed patch object: .{field}: element {_dump(item)} "
                f"does not contain declared merge key: {key}"
            )
    return "k:" + _dump(values)


def strip(obj: Obj, has_status: bool, subresource: str | None) -> Obj:
    """The part of an object field ownership covers (the request's part: main or status)."""
    if subresource == "status":
        return {"status": obj["status"]} if "status" in obj else {}
    result = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    if has_status:
        result.pop("status", None)
    meta = result.get("metadata")
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k not in STRIPPED_META}
        if meta:
            result["metadata"] = meta
        else:
            result.pop("metadata")
    return result


def fieldset(value: Any, shape: Shape, *, update: bool = False) -> FieldSet:
    """The paths a value sets. Apply sets hold leaves, atomic values and keyed items; Update
    sets also hold granular maps and sets themselves (their ``.`` entries)."""
    return frozenset(leaf_values(value, shape, update=update))


def leaf_values(value: Any, shape: Shape, *, update: bool = False) -> dict[Path, Any]:
    """:func:`fieldset` with the value at each path (what :func:`value_at` would find), read
    in the same walk: comparing two writes' values path by path without looking each path
    up again (a Lease renewal's managedFields cost most of its time in those lookups)."""
    out: dict[Path, Any] = {}
    _walk(value, shape, (), out, update)
    return out


def _walk(value: Any, shape: Shape, path: Path, out: dict[Path, Any], update: bool) -> None:
    if isinstance(value, dict):
        if not value or shape.atomic_map(value):
            if path:
                out.setdefault(path, value)
            return
        if update and path and shape.granular():
            out.setdefault(path, value)
        for key, sub in value.items():
            _walk(sub, shape.child(key), (*path, f"f:{key}"), out, update)
    elif isinstance(value, list):
        keys = shape.list_keys(value)
        if keys is None or not value:
            out.setdefault(path, value)
            return
        if keys == ():
            if update:
                out.setdefault(path, value)
            for item in value:
                out.setdefault((*path, "v:" + _dump(item)), item)
            return
        item_shape = shape.item()
        for item in value:
            item_path = (*path, key_element(item, keys, shape.field))
            out.setdefault(item_path, item)
            for key, sub in item.items():
                _walk(sub, item_shape.child(key), (*item_path, f"f:{key}"), out, update)
    elif path:
        out.setdefault(path, value)


def _matches(item: Any, element: str) -> bool:
    if not isinstance(item, dict):
        return False
    wanted = json.loads(element[2:])
    return all(item.get(k, KEY_DEFAULTS.get(k, MISSING)) == v for k, v in wanted.items())


def find_item(items: list[Any], element: str) -> int | None:
    """The index of the list item a ``k:``/``v:`` element names."""
    if element.startswith("v:"):
        wanted = json.loads(element[2:])
        return next((i for i, item in enumerate(items) if item == wanted), None)
    return next((i for i, item in enumerate(items) if _matches(item, element)), None)


def value_at(obj: Any, path: Path) -> Any:
    """The value at ``path``, or ``MISSING``."""
    current = obj
    for element in path:
        if element.startswith("f:"):
            if not isinstance(current, dict) or element[2:] not in current:
                return MISSING
            current = current[element[2:]]
        else:
            if not isinstance(current, list):
                return MISSING
            index = find_item(current, element)
            if index is None:
                return MISSING
            current = current[index]
    return current


def show_path(path: Path) -> str:
    """A path as conflict messages print it: ``.spec.containers[name="app"].image``."""
    text = ""
    for element in path:
        if element.startswith("f:"):
            text += "." + element[2:]
        elif element.startswith("k:"):
            pairs = json.loads(element[2:])
            text += "[" + ",".join(f"{k}={_dump(v)}" for k, v in pairs.items()) + "]"
        elif element.startswith("v:"):
            text += "[=" + element[2:] + "]"
        else:
            text += f"[{element[2:]}]"
    return text


def encode(paths: Iterable[Path]) -> Obj:
    """A field set as the FieldsV1 JSON object (``{"f:spec": {"f:replicas": {}}}``)."""
    tree: Obj = {}
    for path in paths:
        node = tree
        for element in path:
            node = node.setdefault(element, {})
        node["."] = {}
    return _render(tree)


def _render(node: Obj) -> Obj:
    children = {k: _render(v) for k, v in sorted(node.items()) if k != "."}
    if children and "." in node:
        return {".": {}, **children}
    return children


def decode(fields: Any) -> FieldSet:
    """A FieldsV1 JSON object as a set of paths."""
    out: set[Path] = set()

    def walk(node: Any, path: Path) -> None:
        if not isinstance(node, dict):
            return
        if not node and path:
            out.add(path)
        for key, sub in node.items():
            if key == ".":
                out.add(path)
            else:
                walk(sub, (*path, key))

    walk(fields, ())
    return frozenset(out)


def ancestors(paths: Iterable[Path]) -> set[Path]:
    """Every proper prefix of the given paths."""
    return {path[:i] for path in paths for i in range(len(path))}


def changed_leaves(old: dict[Path, Any], new: dict[Path, Any]) -> FieldSet:
    """:func:`changed_paths` from :func:`leaf_values` of both sides (no lookups)."""
    parents = ancestors(new)
    return frozenset(
        path
        for path, value in new.items()
        if path not in old or (path not in parents and old[path] != value)
    )


def changed_paths(old: Any, new: Any, old_set: FieldSet, new_set: FieldSet) -> FieldSet:
    """The paths of ``new_set`` an update set or changed: nodes that appeared, leaves whose
    value is new or different."""
    parents = ancestors(new_set)
    return frozenset(
        path
        for path in new_set
        if path not in old_set
        or (path not in parents and value_at(old, path) != value_at(new, path))
    )

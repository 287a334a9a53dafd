"""Server-side apply (``PATCH`` with ``application/apply-patch+yaml``) and the field manager.

helm v4 and ``kubectl apply --server-side`` create and update everything this way. As on the
real server: the request names its manager (``fieldManager``, required), an object that does
not exist is created (201), the applied configuration merges into the live object (keyed
lists by their merge keys, see managed_fields.py), a field another manager owns with a
different value is a 409 ``Conflict`` whose causes (``FieldManagerConflict``) name manager
and field unless ``force=true`` takes it over, and fields the manager applied before but no
longer applies are removed unless another manager still owns them. Every other write records
an ``Update`` entry for its manager (``fieldManager`` or the User-Agent's first word), so
``managedFields`` reads as on a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import errors
from . import managed_fields as mf
from .managed_fields import MISSING, FieldSet, Path, Shape
from .patches import json_copy

if TYPE_CHECKING:
    from .resources import ResourceType
    from .store import Store

Obj = dict[str, Any]
Recorder = Callable[[Obj | None, Obj], list[Obj]]
MAX_MANAGER = 128


@dataclass(frozen=True)
class Entry:
    """One ``managedFields`` entry with its fields as a path set."""

    manager: str
    operation: str
    api_version: str
    time: str
    fields: FieldSet
    subresource: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.manager, self.operation, self.subresource)

    def as_json(self) -> Obj:
        out: Obj = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "fieldsType": "FieldsV1",
            "fieldsV1": mf.encode(self.fields),
        }
        if self.time:
            out["time"] = self.time
        if self.subresource:
            out["subresource"] = self.subresource
        return out


def read_entries(obj: Obj | None) -> list[Entry]:
    if obj is None:
        return []
    entries = []
    for raw in (obj.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(raw, dict):
            continue
        entries.append(
            Entry(
                raw.get("manager", ""),
                raw.get("operation", "Update"),
                raw.get("apiVersion", ""),
                raw.get("time", ""),
                mf.decode(raw.get("fieldsV1") or {}),
                raw.get("subresource", ""),
            )
        )
    return entries


def _finish(old: list[Entry], new: list[Entry]) -> list[Obj]:
    """Drop empty entries; an entry whose fields did not change keeps its time (so a write
    that changes nothing stays no write, as the real server ignores timestamp-only changes)."""
    before = {e.key: e for e in old}
    out = []
    for entry in new:
        if not entry.fields:
            continue
        prior = before.get(entry.key)
        if prior is not None and prior.fields == entry.fields:
            entry = replace(entry, time=prior.time, api_version=prior.api_version)
        out.append(entry.as_json())
    return out


def manager_name(field_manager: str | None, user_agent: str) -> str:
    """``fieldManager`` if given, else the User-Agent up to its first ``/`` (``kubectl``,
    ``kopf``, ``OpenAPI-Generator``), as the real server names Update managers."""
    if field_manager:
        return field_manager
    return (user_agent.split("/")[0] or "unknown")[:MAX_MANAGER]


def check_manager(field_manager: str | None, is_apply: bool, force: bool) -> None:
    """``PatchOptions``/``UpdateOptions`` validation of the real server (a 422)."""
    causes: list[tuple[str, str, str]] = []
    if is_apply and not field_manager:
        causes.append(
            (
                "FieldValueRequired",
                "fieldManager",
                "fieldManager: Required value: is required for apply patch",
            )
        )
    if force and not is_apply:
        causes.append(
            (
                "FieldValueForbidden",
                "force",
                "force: Forbidden: may not be specified for non-apply patch",
            )
        )
    if field_manager and len(field_manager) > MAX_MANAGER:
        causes.append(
            (
                "FieldValueTooLong",
                "fieldManager",
                f"fieldManager: Too long: may not be more than {MAX_MANAGER} bytes",
            )
        )
    if field_manager and not field_manager.isprintable():
        causes.append(
            (
                "FieldValueInvalid",
                "fieldManager",
                f'fieldManager: Invalid value: "{field_manager}": '
                "must only contain printable characters",
            )
        )
    if causes:
        raise errors.invalid("PatchOptions", "meta.k8s.io", "", causes)


def shape_of(rtype: ResourceType) -> Shape:
    return mf.root_shape(rtype.schema, rtype.custom)


def _covered(path: Path, has_status: bool, subresource: str | None) -> bool:
    """Whether a request on the main resource or its status may touch ``path``."""
    if subresource == "status":
        return path[:1] == ("f:status",)
    return not (has_status and path[:1] == ("f:status",))


# --------------------------------------------------------------------- Update operations
def recorder(
    rtype: ResourceType, manager: str, subresource: str | None, now: Callable[[], str]
) -> Recorder:
    """The ``managedFields`` an ordinary write leaves: the manager's Update entry gains what
    it set or changed, every other entry loses that, and removed fields leave all entries."""
    shape = shape_of(rtype)
    has_status = rtype.has_status

    def record(old: Obj | None, new: Obj) -> list[Obj]:
        entries = read_entries(new)  # the old ones, or those the request set
        old_part = mf.strip(old, has_status, subresource) if old is not None else {}
        new_part = mf.strip(new, has_status, subresource)
        old_values = mf.leaf_values(old_part, shape, update=True)
        new_values = mf.leaf_values(new_part, shape, update=True)
        changed = mf.changed_leaves(old_values, new_values)
        present = new_values.keys() | mf.ancestors(new_values)
        key = (manager, "Update", subresource or "")
        result: list[Entry] = []
        mine: Entry | None = None
        for entry in entries:
            kept = frozenset(
                p for p in entry.fields if p in present or not _covered(p, has_status, subresource)
            )
            if entry.key == key:
                mine = replace(
                    entry, fields=kept | changed, time=now(), api_version=rtype.api_version
                )
                result.append(mine)
            else:
                result.append(replace(entry, fields=kept - changed))
        if mine is None:
            result.append(
                Entry(manager, "Update", rtype.api_version, now(), changed, subresource or "")
            )
        return _finish(entries, result)

    return record


# --------------------------------------------------------------------- Apply
def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def merge(live: Any, applied: Any, shape: Shape) -> Any:
    """The applied configuration merged into the live value (not modified)."""
    if isinstance(applied, dict) and isinstance(live, dict) and not shape.atomic_map(applied):
        result = json_copy(live)
        for key, value in applied.items():
            result[key] = merge(live.get(key, MISSING), value, shape.child(key))
        return result
    if isinstance(applied, list) and isinstance(live, list):
        keys = shape.list_keys(applied + live)
        if keys == ():
            return json_copy(live) + [json_copy(i) for i in applied if i not in live]
        if keys:
            result_list = json_copy(live)
            for item in applied:
                index = mf.find_item(result_list, mf.key_element(item, keys, shape.field))
                if index is None:
                    result_list.append(json_copy(item))
                else:
                    result_list[index] = merge(result_list[index], item, shape.item())
            return result_list
    return json_copy(applied)


def remove_path(obj: Any, path: Path) -> None:
    """Remove the value at ``path`` from ``obj`` in place, if it is there."""
    parent = mf.value_at(obj, path[:-1])
    last = path[-1]
    if isinstance(parent, dict) and last.startswith("f:"):
        parent.pop(last[2:], None)
    elif isinstance(parent, list) and not last.startswith("f:"):
        index = mf.find_item(parent, last)
        if index is not None:
            parent.pop(index)


@dataclass(frozen=True)
class Conflict:
    entry: Entry
    path: Path

    def manager(self) -> str:
        shown = f'"{self.entry.manager}"'
        if self.entry.subresource:
            shown += f' with subresource "{self.entry.subresource}"'
        if self.entry.operation == "Update":
            shown += f" using {self.entry.api_version}"
            if self.entry.time:
                shown += f" at {self.entry.time}"
        return shown


def conflict_error(conflicts: list[Conflict]) -> errors.ApiError:
    """The real server's 409 for apply conflicts (``NewApplyConflict``)."""
    causes = [
        {
            "reason": "FieldManagerConflict",
            "message": f"conflict with {c.manager()}",
            "field": mf.show_path(c.path),
        }
        for c in conflicts
    ]
    if len(conflicts) == 1:
        message = (
            f"Apply failed with 1 conflict: conflict with {conflicts[0].manager()}: "
            f"{mf.show_path(conflicts[0].path)}"
        )
    else:
        by_manager: dict[str, list[Path]] = {}
        for c in conflicts:
            by_manager.setdefault(c.manager(), []).append(c.path)
        lines = []
        for manager in sorted(by_manager):
            lines.append(f"conflicts with {manager}:")
            lines += [f"- {mf.show_path(p)}" for p in by_manager[manager]]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return errors.ApiError(409, "Conflict", message, {"causes": causes})


def find_conflicts(
    live: Any, merged: Any, applied_set: FieldSet, others: list[Entry]
) -> list[Conflict]:
    """Fields of the applied configuration whose value the apply changes (``merged`` is the
    result) and that other managers own."""
    conflicts = []
    for path in sorted(applied_set):
        if not path[-1].startswith("f:") or mf.value_at(live, path) == mf.value_at(merged, path):
            continue
        for entry in others:
            for owned in sorted(entry.fields):
                if owned[: len(path)] == path:
                    conflicts.append(Conflict(entry, owned))
    return conflicts


@dataclass(frozen=True)
class ApplyRequest:
    manager: str
    force: bool
    subresource: str | None
    now: str


def apply_config(
    rtype: ResourceType, live: Obj | None, config: Obj, request: ApplyRequest
) -> tuple[Obj, list[Obj]]:
    """The object after applying ``config`` and its new ``managedFields``."""
    shape = shape_of(rtype)
    has_status, sub = rtype.has_status, request.subresource
    config = _drop_nulls(config)
    applied = mf.strip(config, has_status, sub)
    applied_set = mf.fieldset(applied, shape)
    entries = read_entries(live)
    key = (request.manager, "Apply", sub or "")
    previous = next((e.fields for e in entries if e.key == key), frozenset())
    others = [e for e in entries if e.key != key]
    live_part = mf.strip(live, has_status, sub) if live is not None else {}
    merged = merge(live if live is not None else {}, applied, shape)
    conflicts = find_conflicts(live_part, mf.strip(merged, has_status, sub), applied_set, others)
    if conflicts and not request.force:
        raise conflict_error(conflicts)
    taken: dict[tuple[str, str, str], set[Path]] = {}
    for c in conflicts:
        taken.setdefault(c.entry.key, set()).add(c.path)
    others = [replace(e, fields=e.fields - taken.get(e.key, set())) for e in others]
    owned_by_others: set[Path] = set()
    for entry in others:
        owned_by_others |= entry.fields
    held = owned_by_others | mf.ancestors(owned_by_others) | applied_set
    for path in sorted(previous - applied_set, key=len, reverse=True):
        if path not in held and _covered(path, has_status, sub):
            remove_path(merged, path)
    api_version = config.get("apiVersion") or rtype.api_version
    mine = Entry(request.manager, "Apply", api_version, request.now, applied_set, sub or "")
    by_key = {e.key: e for e in [*others, mine]}
    ordered = [by_key[e.key] for e in entries]
    if not any(e.key == key for e in entries):
        ordered.append(mine)
    return merged, _finish(entries, ordered)


def check_config(rtype: ResourceType, config: Any, name: str) -> Obj:
    """The applied configuration must be an object of this resource with the URL's name."""
    if not isinstance(config, dict):
        raise errors.bad_request("the body of the request must be a JSON or YAML object")
    for field in ("apiVersion", "kind"):
        if not config.get(field):
            raise errors.bad_request(f"invalid object: {field} must be set for apply")
    meta = config.get("metadata") or {}
    if not isinstance(meta, dict):
        raise errors.bad_request("metadata must be an object")
    if meta.get("name") not in (None, name):
        raise errors.bad_request(
            f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
        )
    return config


def serve_apply(
    store: Store,
    rtype: ResourceType,
    namespace: str,
    name: str,
    body: Any,
    request: ApplyRequest,
    flags: dict[str, Any],
) -> tuple[Obj, int]:
    """Apply ``body`` to the named object; returns the result and the HTTP status."""
    config = check_config(rtype, body, name)
    live = store.find(rtype, namespace, name)
    wanted_rv = (config.get("metadata") or {}).get("resourceVersion")
    if live is not None and wanted_rv and wanted_rv != live["metadata"]["resourceVersion"]:
        raise errors.conflict(rtype.plural, rtype.group, name)
    if live is None:
        if request.subresource is not None:
            raise errors.not_found(rtype.plural, rtype.group, name)
        merged, entries = apply_config(rtype, None, config, request)
        meta = merged.setdefault("metadata", {})
        meta["name"] = name
        created = store.create(
            rtype, namespace, merged, managed=lambda _old, _new: entries, **flags
        )
        return created, 201
    merged, entries = apply_config(rtype, live, config, request)
    merged["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
    updated = store.update(
        rtype,
        namespace,
        name,
        merged,
        subresource=request.subresource,
        managed=lambda _old, _new: entries,
        **flags,
    )
    return updated, 200

"""Server-side printing: the ``meta.k8s.io/v1`` ``Table`` that ``kubectl get`` asks for.

kubectl requests ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` and prints the
columns and cells the server sends, so they are computed here as the real server computes
them: the built-in kinds' columns from ``table_printers.py``; a custom resource's
``additionalPrinterColumns`` evaluated by JSONPath (filters included: the RolloutRun's Ready
and Reason columns are ``.status.conditions[?(@.type=="Ready")]``), typed as the CRD says
(``date`` as an age, ``integer``, ``number``, ``boolean``), the first match only, an empty
cell when nothing matches; a CRD without columns gets Age; any other kind NAME and
CREATED AT. ``includeObject`` (``None``, ``Metadata`` — the default — or ``Object``) says
what each row carries: ``kubectl get --sort-by`` asks for the whole object and sorts by it.
"""

from __future__ import annotations

import json
from typing import Any

from . import errors, jsonpath
from .resources import ResourceType
from .table_printers import BUILTIN_COLUMNS, CREATED_AT, NAME, Column, parse_time, since

Obj = dict[str, Any]
INCLUDE_OBJECT = ("None", "Metadata", "Object")


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def json_cell(column_type: str, value: Any) -> Any:
    """apiextensions' ``cellForJSONValue``: the cell of a typed column, None when mistyped."""
    if column_type == "integer":
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return value
        return int(value) if isinstance(value, float) else None
    if column_type == "number":
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if column_type == "boolean":
        return value if isinstance(value, bool) else None
    if column_type == "date":
        return since(value) if isinstance(value, str) and parse_time(value) else None
    if column_type == "string":
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return None


def custom_columns(printer_columns: tuple[Obj, ...]) -> tuple[Column, ...]:
    """A CRD version's ``additionalPrinterColumns`` (Age when it lists none) as columns."""
    if not printer_columns:
        printer_columns = (
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        )
    columns = [NAME]
    for definition in printer_columns:
        path = jsonpath.parse(definition.get("jsonPath", ""))
        column_type = str(definition.get("type", "string"))

        def cell(obj: Obj, path: tuple[jsonpath.Step, ...] = path, kind: str = column_type) -> Any:
            found = jsonpath.find(obj, path)
            return json_cell(kind, found[0]) if found else None

        columns.append(
            Column(
                str(definition.get("name", "")),
                cell,
                type=column_type,
                priority=int(definition.get("priority", 0)),
                format=str(definition.get("format", "")),
            )
        )
    return tuple(columns)


def columns_of(rtype: ResourceType) -> tuple[Column, ...]:
    if rtype.custom:
        return custom_columns(rtype.printer_columns)
    return BUILTIN_COLUMNS.get(rtype.storage_key, CREATED_AT)


def _row_object(item: Obj, include: str) -> Obj | None:
    if include == "None":
        return None
    if include == "Object":
        return item
    partial = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1"}
    return {**partial, "metadata": item["metadata"]}


def include_option(include_object: str | None) -> str:
    """The request's ``includeObject`` checked as ``ValidateTableOptions`` does."""
    include = include_object or "Metadata"
    if include not in INCLUDE_OBJECT:
        raise errors.bad_request(
            "Unable to convert to Table as requested: includeObject: Unsupported value: "
            f'"{include}": supported values: ' + ", ".join(f'"{v}"' for v in sorted(INCLUDE_OBJECT))
        )
    return include


def as_table(
    rtype: ResourceType,
    items: list[Obj],
    meta: Obj,
    include_object: str | None = None,
    headers: bool = True,
) -> Obj:
    """The ``Table`` of ``items``; ``include_object`` is the request's ``includeObject``;
    without ``headers`` the column definitions are left out (``null``), as in a watch."""
    include = include_option(include_object)
    columns = columns_of(rtype)
    definitions = [
        {
            "name": c.name,
            "type": c.type,
            "format": c.format,
            "description": c.name if c.format == "name" else "",
            "priority": c.priority,
        }
        for c in columns
    ]
    rows = [
        {"cells": [c.cell(item) for c in columns], "object": _row_object(item, include)}
        for item in items
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": definitions if headers else None,
        "rows": rows,
    }


class TableStream:
    """Watch events as one-row Tables (``kubectl get -w``): the real server sends the column
    definitions with the first event only. Status (ERROR) and BOOKMARK events stay as they
    are."""

    def __init__(self, rtype: ResourceType, include_object: str | None) -> None:
        self.rtype = rtype
        self.include = include_option(include_object)
        self.headers = True

    def line(self, event_type: str, obj: Obj) -> bytes:
        meta = {"resourceVersion": (obj.get("metadata") or {}).get("resourceVersion", "")}
        table = as_table(self.rtype, [obj], meta, self.include, self.headers)
        self.headers = False
        return json.dumps({"type": event_type, "object": table}).encode() + b"\n"

"""Server-side printing: the ``meta.k8s.io/v1`` ``Table`` that ``kubectl get`` asks for.

kubectl requests ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``; answering it lets
``kubectl get pods`` and ``kubectl get rr`` (with the CRD's ``additionalPrinterColumns``)
print the usual columns against the emulator.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .resources import ResourceType

Obj = dict[str, Any]


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def age(timestamp: str | None, now: datetime | None = None) -> str:
    """``5s``, ``3m``, ``2h``, ``4d`` like kubectl's ``HumanDuration`` (coarsely)."""
    if not timestamp:
        return "<unknown>"
    then = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    seconds = int(((now or datetime.now(UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def json_path(obj: Obj, path: str) -> Any:
    """The value at a simple ``.a.b[0].c`` JSONPath (printer columns use only these)."""
    current: Any = obj
    for part in path.strip().lstrip(".").replace("[", ".").replace("]", "").split("."):
        if part == "":
            continue
        if isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        elif isinstance(current, dict):
            current = current.get(part)
        else:
            return None
    return current


def _pod_cells(pod: Obj) -> list[Any]:
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    total = len((pod.get("spec") or {}).get("containers") or [])
    phase = status.get("phase", "")
    for container in statuses:
        state = container.get("state") or {}
        reason = (state.get("waiting") or state.get("terminated") or {}).get("reason")
        if reason:
            phase = reason
    if pod["metadata"].get("deletionTimestamp"):
        phase = "Terminating"
    restarts = sum(int(s.get("restartCount", 0)) for s in statuses)
    return [
        f"{ready}/{total}",
        phase,
        restarts,
        age(pod["metadata"].get("creationTimestamp")),
        status.get("podIP", "<none>"),
        (pod.get("spec") or {}).get("nodeName", "<none>"),
    ]


def as_table(rtype: ResourceType, items: list[Obj], meta: Obj) -> Obj:
    columns: list[Obj] = [
        {"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}
    ]
    extra: list[tuple[Obj, Any]] = []
    if rtype.storage_key == "pods":
        for name, kind in (
            ("Ready", "string"),
            ("Status", "string"),
            ("Restarts", "integer"),
            ("Age", "string"),
            ("IP", "string"),
            ("Node", "string"),
        ):
            columns.append(
                {
                    "name": name,
                    "type": kind,
                    "format": "",
                    "description": name,
                    "priority": 0 if name not in ("IP", "Node") else 1,
                }
            )
    elif rtype.printer_columns:
        for column in rtype.printer_columns:
            columns.append(
                {
                    "name": column.get("name", ""),
                    "type": column.get("type", "string"),
                    "format": column.get("format", ""),
                    "description": column.get("description", ""),
                    "priority": column.get("priority", 0),
                }
            )
            extra.append((column, column.get("jsonPath", "")))
        if not any(
            c.get("jsonPath") == ".metadata.creationTimestamp" for c in rtype.printer_columns
        ):
            columns.append(
                {"name": "Age", "type": "date", "format": "", "description": "Age", "priority": 0}
            )
    else:
        columns.append(
            {"name": "Age", "type": "string", "format": "", "description": "Age", "priority": 0}
        )
    rows = []
    for item in items:
        cells: list[Any] = [item["metadata"]["name"]]
        if rtype.storage_key == "pods":
            cells += _pod_cells(item)
        elif rtype.printer_columns:
            for column, path in extra:
                value = json_path(item, path)
                cells.append(age(value) if column.get("type") == "date" and value else value)
            if len(cells) < len(columns):
                cells.append(age(item["metadata"].get("creationTimestamp")))
        else:
            cells.append(age(item["metadata"].get("creationTimestamp")))
        partial = {
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": item["metadata"],
        }
        rows.append({"cells": cells, "object": partial})
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": columns,
        "rows": rows,
    }

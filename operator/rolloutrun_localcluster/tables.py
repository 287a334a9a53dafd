"""Server-side printing: the ``meta.k8s.io/v1`` ``Table`` that ``kubectl get`` asks for.

kubectl requests ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``; answering it lets
``kubectl get pods,nodes,svc,ns`` print their usual columns and ``kubectl get rr`` the
CRD's ``additionalPrinterColumns``. Other kinds print NAME and AGE.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .resources import ResourceType

Obj = dict[str, Any]
Cell = Callable[[Obj], Any]


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


def _age(obj: Obj) -> str:
    return age(obj["metadata"].get("creationTimestamp"))


def _pod_status(pod: Obj) -> str:
    status = pod.get("status") or {}
    phase = str(status.get("phase", ""))
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        reason = (state.get("waiting") or state.get("terminated") or {}).get("reason")
        if reason:
            phase = reason
    return "Terminating" if pod["metadata"].get("deletionTimestamp") else phase


def _pod_ready(pod: Obj) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _node_status(node: Obj) -> str:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready: Obj = next((c for c in conditions if c.get("type") == "Ready"), {})
    text = "Ready" if ready.get("status") == "True" else "NotReady"
    return text + (",SchedulingDisabled" if (node.get("spec") or {}).get("unschedulable") else "")


def _ports(service: Obj) -> str:
    ports = (service.get("spec") or {}).get("ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


BUILTIN_COLUMNS: dict[str, list[tuple[str, int, Cell]]] = {
    "pods": [
        ("Ready", 0, _pod_ready),
        ("Status", 0, _pod_status),
        (
            "Restarts",
            0,
            lambda p: sum(
                int(s.get("restartCount", 0))
                for s in (p.get("status") or {}).get("containerStatuses") or []
            ),
        ),
        ("Age", 0, _age),
        ("IP", 1, lambda p: (p.get("status") or {}).get("podIP", "<none>")),
        ("Node", 1, lambda p: (p.get("spec") or {}).get("nodeName", "<none>")),
    ],
    "nodes": [
        ("Status", 0, _node_status),
        ("Roles", 0, lambda n: "<none>"),
        ("Age", 0, _age),
        ("Version", 0, lambda n: json_path(n, ".status.nodeInfo.kubeletVersion") or ""),
    ],
    "services": [
        ("Type", 0, lambda s: (s.get("spec") or {}).get("type", "ClusterIP")),
        ("Cluster-IP", 0, lambda s: (s.get("spec") or {}).get("clusterIP", "<none>")),
        ("External-IP", 0, lambda s: "<none>"),
        ("Port(s)", 0, _ports),
        ("Age", 0, _age),
    ],
    "namespaces": [
        ("Status", 0, lambda n: (n.get("status") or {}).get("phase", "")),
        ("Age", 0, _age),
    ],
}


def _columns(rtype: ResourceType) -> list[tuple[Obj, Cell]]:
    if rtype.storage_key in BUILTIN_COLUMNS:
        return [
            (
                {
                    "name": name,
                    "type": "string",
                    "format": "",
                    "description": name,
                    "priority": prio,
                },
                cell,
            )
            for name, prio, cell in BUILTIN_COLUMNS[rtype.storage_key]
        ]
    result: list[tuple[Obj, Cell]] = []
    for column in rtype.printer_columns:
        definition = {
            "name": column.get("name", ""),
            "type": column.get("type", "string"),
            "format": column.get("format", ""),
            "description": column.get("description", ""),
            "priority": column.get("priority", 0),
        }
        path, is_date = column.get("jsonPath", ""), column.get("type") == "date"

        def cell(obj: Obj, path: str = path, is_date: bool = is_date) -> Any:
            value = json_path(obj, path)
            return age(value) if is_date and value else value

        result.append((definition, cell))
    if not any(c.get("jsonPath") == ".metadata.creationTimestamp" for c in rtype.printer_columns):
        age_column = {"name": "Age", "type": "date", "format": "", "description": "", "priority": 0}
        result.append((age_column, _age))
    return result


def as_table(rtype: ResourceType, items: list[Obj], meta: Obj) -> Obj:
    name = {
        "name": "Name",
        "type": "string",
        "format": "name",
        "description": "Name",
        "priority": 0,
    }
    columns = _columns(rtype)
    rows = []
    for item in items:
        cells = [item["metadata"]["name"], *(cell(item) for _, cell in columns)]
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
        "columnDefinitions": [name, *(definition for definition, _ in columns)],
        "rows": rows,
    }

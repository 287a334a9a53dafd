"""The columns the real API server prints for the built-in kinds (its ``printers.go``).

``kubectl get`` prints what the server puts in the ``Table``; these are the same columns,
cells and priorities (priority 1 is ``-o wide``) as Kubernetes 1.32 answers for the kinds the
local cluster serves: Events without a leading NAME (``LAST SEEN TYPE REASON OBJECT
MESSAGE``), pods, nodes, services, namespaces, config maps, secrets, service accounts,
endpoints, quotas, leases, RBAC objects, network policies, claims and storage classes. A kind
not listed here gets the server's default table (NAME, CREATED AT). Pure functions of one
object; ``tables.py`` assembles them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .store import rfc3339

Obj = dict[str, Any]

ZERO_DATE = "<unknown>"


@dataclass(frozen=True)
class Column:
    name: str
    cell: Callable[[Obj], Any]
    type: str = "string"
    priority: int = 0
    format: str = ""


def parse_time(timestamp: str | None) -> datetime | None:
    """An RFC 3339 time as the API writes it (``Z``, optionally with fractional seconds)."""
    if not timestamp:
        return None
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """apimachinery's ``duration.HumanDuration``: ``45s``, ``5m3s``, ``3h4m``, ``2d5h``, ``3y``."""
    total = int(seconds)
    if total < -1:
        return "<invalid>"
    if total < 0:
        return "0s"
    if total < 120:
        return f"{total}s"
    minutes, hours = total // 60, total // 3600
    if minutes < 10:
        return f"{minutes}m" + (f"{total % 60}s" if total % 60 else "")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h" + (f"{minutes % 60}m" if minutes % 60 else "")
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" + (f"{hours % 24}h" if hours % 24 else "")
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" + (f"{days}d" if days else "")
    return f"{hours // 24 // 365}y"


def since(timestamp: str | None, now: datetime | None = None) -> str:
    """``translateTimestampSince``: the age of a timestamp, ``<unknown>`` when unset."""
    moment = parse_time(timestamp)
    if moment is None:
        return ZERO_DATE
    return human_duration(((now or datetime.now(UTC)) - moment).total_seconds())


def _meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def _spec(obj: Obj) -> Obj:
    return obj.get("spec") or {}


def _status(obj: Obj) -> Obj:
    return obj.get("status") or {}


def name(obj: Obj) -> str:
    return str(_meta(obj).get("name", ""))


def age(obj: Obj) -> str:
    return since(_meta(obj).get("creationTimestamp"))


def created_at(obj: Obj) -> str:
    moment = parse_time(_meta(obj).get("creationTimestamp"))
    return rfc3339(moment) if moment else ""


NAME = Column("Name", name, format="name")
AGE = Column("Age", age)


# ---------------------------------------------------------------------------- pods, nodes
def _pod_status(pod: Obj) -> str:
    status = _status(pod)
    reason = str(status.get("reason") or status.get("phase", ""))
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif (state.get("terminated") or {}).get("reason"):
            reason = state["terminated"]["reason"]
        elif state.get("terminated"):
            terminated = state["terminated"]
            code = terminated.get("exitCode", 0)
            reason = (
                f"Signal:{terminated['signal']}" if terminated.get("signal") else f"ExitCode:{code}"
            )
    if _meta(pod).get("deletionTimestamp"):
        return "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return reason


def _pod_ready(pod: Obj) -> str:
    statuses = _status(pod).get("containerStatuses") or []
    total = len(_spec(pod).get("containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _pod_restarts(pod: Obj) -> str:
    restarts, last = 0, None
    for container in _status(pod).get("containerStatuses") or []:
        restarts += int(container.get("restartCount", 0))
        finished = ((container.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
        moment = parse_time(finished)
        if moment is not None and (last is None or moment > last):
            last = moment
    if restarts and last is not None:
        return f"{restarts} ({human_duration((datetime.now(UTC) - last).total_seconds())} ago)"
    return str(restarts)


def _pod_gates(pod: Obj) -> str:
    gates = _spec(pod).get("readinessGates") or []
    if not gates:
        return "<none>"
    conditions = {c.get("type"): c.get("status") for c in _status(pod).get("conditions") or []}
    ready = sum(1 for g in gates if conditions.get(g.get("conditionType")) == "True")
    return f"{ready}/{len(gates)}"


def _node_status(node: Obj) -> str:
    conditions = _status(node).get("conditions") or []
    ready: Obj = next((c for c in conditions if c.get("type") == "Ready"), {})
    text = {"True": "Ready", "False": "NotReady"}.get(str(ready.get("status")), "Unknown")
    return text + (",SchedulingDisabled" if _spec(node).get("unschedulable") else "")


def _node_roles(node: Obj) -> str:
    prefix = "node-role.kubernetes.io/"
    labels = _meta(node).get("labels") or {}
    roles = sorted(k[len(prefix) :] for k in labels if k.startswith(prefix) and k != prefix)
    roles += [v for k, v in labels.items() if k == "kubernetes.io/role" and v]
    return ",".join(sorted(set(roles))) or "<none>"


def _node_address(kind: str) -> Callable[[Obj], str]:
    def cell(node: Obj) -> str:
        addresses = _status(node).get("addresses") or []
        return next((a["address"] for a in addresses if a.get("type") == kind), "<none>")

    return cell


def _node_info(key: str) -> Callable[[Obj], str]:
    return lambda node: str((_status(node).get("nodeInfo") or {}).get(key, ""))


# ---------------------------------------------------------------------------- services
def _service_external_ip(service: Obj) -> str:
    spec = _spec(service)
    kind = spec.get("type", "ClusterIP")
    external = list(spec.get("externalIPs") or [])
    if kind == "ExternalName":
        return str(spec.get("externalName", ""))
    if kind == "LoadBalancer":
        ingress = (_status(service).get("loadBalancer") or {}).get("ingress") or []
        found = [i.get("ip") or i.get("hostname") for i in ingress] + external
        return ",".join(str(f) for f in found if f) or "<pending>"
    return ",".join(external) or "<none>"


def _service_ports(service: Obj) -> str:
    parts = []
    for port in _spec(service).get("ports") or []:
        node = f":{port['nodePort']}" if port.get("nodePort") else ""
        parts.append(f"{port.get('port')}{node}/{port.get('protocol', 'TCP')}")
    return ",".join(parts) or "<none>"


def format_labels(labels: Obj | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "<none>"


def format_selector(selector: Obj | None) -> str:
    """``metav1.FormatLabelSelector``: ``app=x,tier in (a,b)``; ``<none>`` for an empty one."""
    if not selector:
        return "<none>"
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        operator, values = expr.get("operator", ""), ",".join(expr.get("values") or [])
        spelled = {"In": "in", "NotIn": "notin"}.get(operator)
        if spelled:
            parts.append(f"{expr['key']} {spelled} ({values})")
        else:
            parts.append(("!" if operator == "DoesNotExist" else "") + expr["key"])
    return ",".join(parts) or "<none>"


def _endpoints(endpoints: Obj) -> str:
    found = []
    for subset in endpoints.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or []] or [None]
        for address in subset.get("addresses") or []:
            for port in ports:
                found.append(f"{address.get('ip')}:{port}" if port else str(address.get("ip")))
    if not found:
        return "<none>"
    more = f" + {len(found) - 3} more..." if len(found) > 3 else ""
    return ",".join(found[:3]) + more


# ---------------------------------------------------------------------------- events
def event_last_seen(event: Obj) -> str:
    """``printEvent``: the series' last observation, else lastTimestamp, else first seen."""
    series = event.get("series") or {}
    if series:
        return since(series.get("lastObservedTime"))
    if event.get("lastTimestamp"):
        return since(event["lastTimestamp"])
    return event_first_seen(event)


def event_first_seen(event: Obj) -> str:
    return since(event.get("firstTimestamp") or event.get("eventTime"))


def _event_object(event: Obj) -> str:
    involved = event.get("involvedObject") or {}
    kind = str(involved.get("kind", "")).lower()
    return f"{kind}/{involved['name']}" if involved.get("name") else kind


def _event_source(event: Obj) -> str:
    source = event.get("source") or {}
    component = source.get("component") or event.get("reportingComponent") or ""
    instance = source.get("host") or event.get("reportingInstance") or ""
    return f"{component}, {instance}" if instance else str(component)


def _event_count(event: Obj) -> int:
    series = event.get("series") or {}
    return int(series.get("count") or event.get("count") or 1)


# ---------------------------------------------------------------------------- the rest
def _quota(limits: bool) -> Callable[[Obj], str]:
    def cell(quota: Obj) -> str:
        hard, used = _status(quota).get("hard") or {}, _status(quota).get("used") or {}
        chosen = [r for r in sorted(hard) if (r.split(".")[0] == "limits" and "." in r) == limits]
        return ", ".join(f"{r}: {used.get(r, '0')}/{hard[r]}" for r in chosen)

    return cell


def _deployment_ready(deployment: Obj) -> str:
    """``ready/desired``; a Deployment this cluster stores but runs (no controller here) stays
    ``0/N``, as one whose pods never start does on a real cluster."""
    desired = _spec(deployment).get("replicas", 1)
    return f"{_status(deployment).get('readyReplicas', 0)}/{desired}"


def _containers(key: str) -> Callable[[Obj], str]:
    def cell(workload: Obj) -> str:
        template = _spec(workload).get("template") or {}
        containers = (template.get("spec") or {}).get("containers") or []
        return ",".join(str(c.get(key, "")) for c in containers)

    return cell


def _binding_role(binding: Obj) -> str:
    ref = binding.get("roleRef") or {}
    return f"{ref.get('kind', '')}/{ref.get('name', '')}"


def _subjects(kind: str) -> Callable[[Obj], str]:
    def cell(binding: Obj) -> str:
        subjects = [s for s in binding.get("subjects") or [] if s.get("kind") == kind]
        if kind == "ServiceAccount":
            return ", ".join(f"{s.get('namespace', '')}/{s.get('name', '')}" for s in subjects)
        return ", ".join(str(s.get("name", "")) for s in subjects)

    return cell


ACCESS_MODES = {
    "ReadWriteOnce": "RWO",
    "ReadOnlyMany": "ROX",
    "ReadWriteMany": "RWX",
    "ReadWriteOncePod": "RWOP",
}


def _access_modes(claim: Obj) -> str:
    modes = _status(claim).get("accessModes") or []
    return ",".join(ACCESS_MODES.get(m, m) for m in modes)


def _storage_class_name(storage_class: Obj) -> str:
    annotations = _meta(storage_class).get("annotations") or {}
    keys = (
        "storageclass.kubernetes.io/is-default-class",
        "storageclass.beta.kubernetes.io/is-default-class",
    )
    default = any(annotations.get(k) == "true" for k in keys)
    return name(storage_class) + (" (default)" if default else "")


def _get(*path: str, default: Any = "") -> Callable[[Obj], Any]:
    def cell(obj: Obj) -> Any:
        value: Any = obj
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return default if value is None else value

    return cell


BINDING_COLUMNS = (
    NAME,
    Column("Role", _binding_role),
    AGE,
    Column("Users", _subjects("User"), priority=1),
    Column("Groups", _subjects("Group"), priority=1),
    Column("ServiceAccounts", _subjects("ServiceAccount"), priority=1),
)
CREATED_AT = (NAME, Column("Created At", created_at, type="date"))

BUILTIN_COLUMNS: dict[str, tuple[Column, ...]] = {
    "pods": (
        NAME,
        Column("Ready", _pod_ready),
        Column("Status", _pod_status),
        Column("Restarts", _pod_restarts),
        AGE,
        Column("IP", _get("status", "podIP", default="<none>"), priority=1),
        Column("Node", _get("spec", "nodeName", default="<none>"), priority=1),
        Column("Nominated Node", _get("status", "nominatedNodeName", default="<none>"), priority=1),
        Column("Readiness Gates", _pod_gates, priority=1),
    ),
    "nodes": (
        NAME,
        Column("Status", _node_status),
        Column("Roles", _node_roles),
        AGE,
        Column("Version", _node_info("kubeletVersion")),
        Column("Internal-IP", _node_address("InternalIP"), priority=1),
        Column("External-IP", _node_address("ExternalIP"), priority=1),
        Column("OS-Image", _node_info("osImage"), priority=1),
        Column("Kernel-Version", _node_info("kernelVersion"), priority=1),
        Column("Container-Runtime", _node_info("containerRuntimeVersion"), priority=1),
    ),
    "services": (
        NAME,
        Column("Type", _get("spec", "type", default="ClusterIP")),
        Column("Cluster-IP", _get("spec", "clusterIP", default="<none>")),
        Column("External-IP", _service_external_ip),
        Column("Port(s)", _service_ports),
        AGE,
        Column("Selector", lambda s: format_labels(_spec(s).get("selector")), priority=1),
    ),
    "namespaces": (NAME, Column("Status", _get("status", "phase")), AGE),
    "configmaps": (
        NAME,
        Column(
            "Data", lambda c: len(c.get("data") or {}) + len(c.get("binaryData") or {}), "integer"
        ),
        AGE,
    ),
    "secrets": (
        NAME,
        Column("Type", _get("type")),
        Column("Data", lambda s: len(s.get("data") or {}), "integer"),
        AGE,
    ),
    "serviceaccounts": (
        NAME,
        Column("Secrets", lambda s: len(s.get("secrets") or []), "integer"),
        AGE,
    ),
    "endpoints": (NAME, Column("Endpoints", _endpoints), AGE),
    "events": (
        Column("Last Seen", event_last_seen),
        Column("Type", _get("type")),
        Column("Reason", _get("reason")),
        Column("Object", _event_object),
        Column("Subobject", _get("involvedObject", "fieldPath"), priority=1),
        Column("Source", _event_source, priority=1),
        Column("Message", lambda e: str(e.get("message", "")).strip()),
        Column("First Seen", event_first_seen, priority=1),
        Column("Count", _event_count, priority=1),
        Column("Name", name, priority=1, format="name"),
    ),
    "deployments.apps": (
        NAME,
        Column("Ready", _deployment_ready),
        Column("Up-to-date", _get("status", "updatedReplicas", default=0), "integer"),
        Column("Available", _get("status", "availableReplicas", default=0), "integer"),
        AGE,
        Column("Containers", _containers("name"), priority=1),
        Column("Images", _containers("image"), priority=1),
        Column("Selector", lambda d: format_selector(_spec(d).get("selector")), priority=1),
    ),
    "resourcequotas": (NAME, AGE, Column("Request", _quota(False)), Column("Limit", _quota(True))),
    "leases.coordination.k8s.io": (NAME, Column("Holder", _get("spec", "holderIdentity")), AGE),
    "roles.rbac.authorization.k8s.io": CREATED_AT,
    "clusterroles.rbac.authorization.k8s.io": CREATED_AT,
    "rolebindings.rbac.authorization.k8s.io": BINDING_COLUMNS,
    "clusterrolebindings.rbac.authorization.k8s.io": BINDING_COLUMNS,
    "networkpolicies.networking.k8s.io": (
        NAME,
        Column("Pod-Selector", lambda p: format_selector(_spec(p).get("podSelector"))),
        AGE,
    ),
    "persistentvolumeclaims": (
        NAME,
        Column("Status", _get("status", "phase")),
        Column("Volume", _get("spec", "volumeName")),
        Column("Capacity", _get("status", "capacity", "storage")),
        Column("Access Modes", _access_modes),
        Column("StorageClass", _get("spec", "storageClassName")),
        Column(
            "VolumeAttributesClass", _get("spec", "volumeAttributesClassName", default="<unset>")
        ),
        AGE,
        Column("VolumeMode", _get("spec", "volumeMode", default="<unset>"), priority=1),
    ),
    "poddisruptionbudgets.policy": (
        NAME,
        Column("Min Available", lambda p: str(_get("spec", "minAvailable", default="N/A")(p))),
        Column("Max Unavailable", lambda p: str(_get("spec", "maxUnavailable", default="N/A")(p))),
        Column("Allowed Disruptions", _get("status", "disruptionsAllowed", default=0), "integer"),
        AGE,
    ),
    "storageclasses.storage.k8s.io": (
        Column("Name", _storage_class_name, format="name"),
        Column("Provisioner", _get("provisioner")),
        Column("ReclaimPolicy", _get("reclaimPolicy", default="Delete")),
        Column("VolumeBindingMode", _get("volumeBindingMode", default="Immediate")),
        Column("AllowVolumeExpansion", _get("allowVolumeExpansion", default=False)),
        AGE,
    ),
}

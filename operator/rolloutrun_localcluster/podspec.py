"""Pure pod-spec decisions of the process kubelet: environment, argv, restarts, status.

Kept free of I/O so each rule is unit-testable against the Kubernetes documentation:
``$(VAR)`` expansion in env values, command and args; env from literals, ConfigMap and
Secret keys (``env`` and ``envFrom``) and the downward API; restart decisions per
``restartPolicy``; and the pod phase, conditions and ``containerStatuses`` a kubelet reports.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
Lookup = Callable[[str, str], Obj | None]  # (namespace, name) -> object or None

_VAR_RE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class ConfigError(Exception):
    """A container cannot be configured yet (``CreateContainerConfigError``)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names expand, ``$$`` escapes, others stay."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_RE.sub(replace, text)


def downward_value(pod: Obj, path: str) -> str:
    """The value of a ``fieldRef.fieldPath`` for this pod."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return str((meta.get(match[1]) or {}).get(match[2], ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(ip.get("ip", "") for ip in status.get("podIPs") or []),
        "status.hostIPs": ",".join(ip.get("ip", "") for ip in status.get("hostIPs") or []),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldPath: {path}")
    return str(simple[path] or "")


def mounts_token(pod: Obj, account: Obj | None) -> bool:
    """Whether the pod gets a service-account token: the pod's
    ``automountServiceAccountToken`` wins when set, else its ServiceAccount's, else yes (the
    Kubernetes rule). The token is the account's own (see ``identity``)."""
    own = (pod.get("spec") or {}).get("automountServiceAccountToken")
    if own is not None:
        return bool(own)
    inherited = (account or {}).get("automountServiceAccountToken")
    return True if inherited is None else bool(inherited)


def _key_value(kind: str, ref: Obj, namespace: str, lookup: Lookup) -> str | None:
    source = lookup(namespace, ref.get("name", ""))
    noun = "configmap" if kind == "configMap" else "secret"
    if source is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{noun} "{ref.get("name")}" not found')
    data = source.get("data") or {}
    key = ref.get("key", "")
    if key not in data and not (kind == "configMap" and key in (source.get("binaryData") or {})):
        if ref.get("optional"):
            return None
        raise ConfigError(
            f"couldn't find key {key} in {noun.capitalize()} {namespace}/{ref.get('name')}"
        )
    if kind == "secret":
        return base64.b64decode(data[key]).decode()
    return str(data.get(key, ""))


def container_env(
    pod: Obj,
    container: Obj,
    configmaps: Lookup,
    secrets: Lookup,
    base: Mapping[str, str],
) -> dict[str, str]:
    """The environment a container runs with: ``base``, then ``envFrom``, then ``env``."""
    namespace = pod["metadata"].get("namespace", "")
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, lookup in (("configMapRef", configmaps), ("secretRef", secrets)):
            ref = source.get(kind)
            if ref is None:
                continue
            obj = lookup(namespace, ref.get("name", ""))
            if obj is None:
                if ref.get("optional"):
                    continue
                noun = "configmap" if kind == "configMapRef" else "secret"
                raise ConfigError(f'{noun} "{ref.get("name")}" not found')
            for key, raw in (obj.get("data") or {}).items():
                decoded = base64.b64decode(raw).decode() if kind == "secretRef" else str(raw)
                env[prefix + key] = decoded
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item or "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        source = item["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = downward_value(pod, source["fieldRef"].get("fieldPath", ""))
        elif "configMapKeyRef" in source:
            value = _key_value("configMap", source["configMapKeyRef"], namespace, configmaps)
        elif "secretKeyRef" in source:
            value = _key_value("secret", source["secretKeyRef"], namespace, secrets)
        elif "resourceFieldRef" in source:
            value = _resource_value(container, source["resourceFieldRef"])
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def _resource_value(container: Obj, ref: Obj) -> str:
    """Limits are not enforced; the value is what the spec says (``0`` when unset)."""
    resource = ref.get("resource", "")
    section, _, name = resource.partition(".")
    value = ((container.get("resources") or {}).get(section) or {}).get(name)
    return str(value) if value is not None else "0"


def container_argv(container: Obj, env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded; there is no image entrypoint."""
    command = [expand(str(part), env) for part in container.get("command") or []]
    args = [expand(str(part), env) for part in container.get("args") or []]
    return command + args


def should_restart(policy: str, exit_code: int) -> bool:
    """Whether a terminated container is restarted under the pod's ``restartPolicy``."""
    if policy == "Always":
        return True
    if policy == "OnFailure":
        return exit_code != 0
    return False


#: The kubelet's container restart back-off: first delay and cap (seconds); a container that
#: ran twice the cap since its last back-off starts again from the first delay.
RESTART_BACKOFF = (10.0, 300.0)


def next_delay(base: float, cap: float, failures: int) -> float:
    """The back-off after the ``failures``-th consecutive failure (1-based): ``base``,
    doubling, at most ``cap`` (the kubelet's restart and image pull back-offs alike)."""
    return min(cap, base * 2 ** min(max(failures - 1, 0), 30))


def go_duration(seconds: float) -> str:
    """A duration as Go's ``time.Duration`` prints it (``10s``, ``5m0s``, ``200ms``)."""
    if seconds < 1:
        return f"{round(seconds * 1000):d}ms"
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{rest:g}s"
    if minutes or hours:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def exit_code_of(returncode: int) -> int:
    """A killed process reports 128 + the signal number, as container runtimes do."""
    return 128 - returncode if returncode < 0 else returncode


#: What ``FallbackToLogsOnError`` keeps of a failed container's log: the smaller of these.
TERMINATION_MESSAGE_LINES = 80
TERMINATION_MESSAGE_BYTES = 2048


def termination_message(container: Mapping[str, Any], exit_code: int, log_tail: bytes) -> str:
    """A terminated container's ``message``: with ``terminationMessagePolicy:
    FallbackToLogsOnError`` and a failure, the end of its log (the last 80 lines or 2048
    bytes, whichever is smaller), as the kubelet reports it. ``terminationMessagePath`` files
    are not read (a process kubelet has no per-container ``/dev``)."""
    if exit_code == 0 or container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    lines = log_tail.splitlines(keepends=True)[-TERMINATION_MESSAGE_LINES:]
    tail = b"".join(lines)[-TERMINATION_MESSAGE_BYTES:]
    return tail.decode("utf-8", errors="replace")


@dataclass
class ContainerRecord:
    """What the kubelet knows about one container, enough to report its status."""

    name: str
    image: str = ""
    state: str = "waiting"  # waiting, running, terminated
    reason: str = "ContainerCreating"
    message: str = ""
    exit_code: int = 0
    started_at: str = ""
    finished_at: str = ""
    restart_count: int = 0
    pid: int = 0
    ready: bool = False
    last_state: Obj = field(default_factory=dict)
    will_restart: bool = False
    backoff_steps: int = 0  # consecutive restarts since the back-off was last reset
    backoff_at: float | None = None  # monotonic time of the last back-off

    def status(self) -> Obj:
        if self.state == "running":
            state: Obj = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            terminated: Obj = {
                "exitCode": self.exit_code,
                "reason": self.reason,
                "startedAt": self.started_at or None,
                "finishedAt": self.finished_at,
                "containerID": f"local://{self.pid}" if self.pid else None,
            }
            if self.message:
                terminated["message"] = self.message
            state = {"terminated": {k: v for k, v in terminated.items() if v is not None}}
        else:
            waiting: Obj = {"reason": self.reason}
            if self.message:
                waiting["message"] = self.message
            state = {"waiting": waiting}
        result: Obj = {
            "name": self.name,
            "state": state,
            "lastState": self.last_state,
            "ready": self.ready,
            "restartCount": self.restart_count,
            "image": self.image,
            "imageID": "",
            "started": self.state == "running",
        }
        if self.pid:
            result["containerID"] = f"local://{self.pid}"
        return result


def restart_delay(record: ContainerRecord, now: float, base: float, cap: float) -> float:
    """The back-off before ``record``'s next restart (``now`` on a monotonic clock): the
    kubelet's, doubling per consecutive restart and forgotten once the container has gone
    twice the cap (10 minutes) without one."""
    if record.backoff_at is not None and now - record.backoff_at > 2 * cap:
        record.backoff_steps = 0
    record.backoff_steps += 1
    record.backoff_at = now
    return next_delay(base, cap, record.backoff_steps)


def pod_phase(init: list[ContainerRecord], main: list[ContainerRecord], policy: str) -> str:
    """Pending until every container has started once; Succeeded/Failed when all are done."""
    if any(c.state == "terminated" and c.exit_code != 0 and not c.will_restart for c in init):
        return "Failed"
    if any(c.state != "terminated" or c.exit_code != 0 for c in init):
        return "Pending"
    if any(c.state == "waiting" and not c.restart_count and not c.last_state for c in main):
        return "Pending"
    if all(c.state == "terminated" and not c.will_restart for c in main):
        return "Succeeded" if all(c.exit_code == 0 for c in main) else "Failed"
    return "Running"


def conditions(
    old: list[Obj],
    *,
    scheduled: bool,
    initialized: bool,
    ready: bool,
    now: str,
    ready_reason: str = "",
) -> list[Obj]:
    """Pod conditions, keeping each ``lastTransitionTime`` until its status changes; the
    conditions the kubelet does not own (``DisruptionTarget`` from an eviction, a readiness
    gate's) are kept as they are, as the kubelet keeps them."""
    previous = {c.get("type"): c for c in old}
    wanted = [
        ("PodScheduled", scheduled, ""),
        ("Initialized", initialized, "" if initialized else "ContainersNotInitialized"),
        ("ContainersReady", ready, "" if ready else ready_reason or "ContainersNotReady"),
        ("Ready", ready, "" if ready else ready_reason or "ContainersNotReady"),
    ]
    result = []
    for kind, value, reason in wanted:
        status = "True" if value else "False"
        before = previous.get(kind)
        transition = (
            before.get("lastTransitionTime") if before and before.get("status") == status else now
        )
        condition: Obj = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": transition,
        }
        if reason:
            condition["reason"] = reason
        result.append(condition)
    owned = {kind for kind, _, _ in wanted}
    return result + [c for c in old if c.get("type") not in owned]


#: The phases a pod never leaves.
TERMINAL_PHASES = ("Succeeded", "Failed")


def deleted_before_start(status: Obj, now: str) -> Obj | None:
    """The status a kubelet writes for a pod of its node deleted before any container
    started (Kubernetes >= 1.27): phase ``Failed``, not ready, the rest kept -- so a pod a
    finalizer holds reads terminal, not ``Pending`` forever. None if already terminal."""
    if status.get("phase") in TERMINAL_PHASES:
        return None
    initialized = any(
        c.get("type") == "Initialized" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return {
        **status,
        "phase": "Failed",
        "conditions": conditions(
            status.get("conditions") or [],
            scheduled=True,  # the kubelet of its node
            initialized=initialized,
            ready=False,
            now=now,
            ready_reason="PodCompleted",
        ),
    }

"""RolloutRuns and observations for the operator's pure tests (imported by name, not a conftest)."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from rolloutrun_operator import naming
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.api.validation import parse_rolloutrun
from rolloutrun_operator.observe import LeaseView, Observed, PodView

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
RUN = "demo"
#: The tables' "now": a minute after :data:`T0`.
NOW = T0 + dt.timedelta(seconds=60)

BASE: dict[str, Any] = {
    "apiVersion": "rolloutrun.dev/v1alpha1",
    "kind": "RolloutRun",
    "metadata": {"name": RUN, "namespace": "ns", "uid": "uid-1", "generation": 1},
    "spec": {
        "storage": {"uri": "file:///data/demo", "volumeClaimName": "demo-storage"},
        "gym": {"replicas": 2, "port": 8000},
        "recovery": {
            "maxRestarts": 2,
            "backoffSeconds": 5,
            "maxBackoffSeconds": 60,
            "stablePeriodSeconds": 600,
            "nodeLossTimeoutSeconds": 40,
            "leaseDurationSeconds": 15,
        },
        "run": {"grpo": {"maxSteps": 30}, "workers": {"backend": "inprocess"}},
    },
}


def make_run(status: dict[str, Any] | None = None, **spec: Any) -> RolloutRun:
    """A valid RolloutRun ``demo`` with ``spec`` merged (one level deep; ``storage``
    replaced) and ``status``."""
    document = copy.deepcopy(BASE)
    for key, value in spec.items():
        if key == "storage":  # a unit: a gs:// uri takes no claim
            document["spec"][key] = value
        elif isinstance(value, dict) and isinstance(document["spec"].get(key), dict):
            document["spec"][key] = {**document["spec"][key], **value}
        else:
            document["spec"][key] = value
    if status is not None:
        document["status"] = status
    return parse_rolloutrun(document)


STATIC = frozenset(
    {
        f"ServiceAccount/{RUN}-member",
        f"Role/{RUN}-member",
        f"RoleBinding/{RUN}-member",
        f"Secret/{RUN}-gym-token",
        f"Secret/{RUN}-metrics-token",
        f"Lease/{RUN}-trainer",
        f"Service/{RUN}-trainer",
        f"Service/{RUN}-gym",
        f"NetworkPolicy/{RUN}-gym-ingress",
        f"NetworkPolicy/{RUN}-generation-ingress",
    }
)


def gym(incarnation: int, index: int, **fields: Any) -> PodView:
    defaults: dict[str, Any] = {
        "phase": "Running",
        "pod_ip": f"127.0.0.{10 + index}",
        "node_name": "node-a",
        "ready": True,
    }
    return PodView(
        name=naming.gym_pod_name(RUN, incarnation, index),
        role="gym",
        incarnation=incarnation,
        gym_index=index,
        **{**defaults, **fields},
    )


def trainer(incarnation: int, **fields: Any) -> PodView:
    defaults: dict[str, Any] = {
        "phase": "Running",
        "pod_ip": "127.0.0.2",
        "node_name": "node-a",
        "ready": True,
    }
    return PodView(
        name=naming.trainer_pod_name(RUN, incarnation),
        role="trainer",
        incarnation=incarnation,
        **{**defaults, **fields},
    )


def members(incarnation: int) -> tuple[PodView, ...]:
    return (trainer(incarnation), gym(incarnation, 0), gym(incarnation, 1))


def observed(pods: tuple[PodView, ...] = (), **fields: Any) -> Observed:
    defaults: dict[str, Any] = {"present": STATIC, "config": {}, "new_token": "tok"}
    return Observed(pods=pods, **{**defaults, **fields})


def lease(incarnation: int, renewed: dt.datetime, **fields: Any) -> LeaseView:
    """The trainer Lease of ``incarnation``, its ``renewTime`` ``renewed`` (the trainer's
    clock, written as Kubernetes writes a MicroTime)."""
    return LeaseView(
        holder=naming.holder_identity(naming.trainer_pod_name(RUN, incarnation), incarnation),
        renew_time=renewed.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        duration_seconds=15,
        **fields,
    )


def running_status(incarnation: int = 1, **fields: Any) -> dict[str, Any]:
    """Status of a run whose incarnation ``incarnation`` launched at T0."""
    return {
        "incarnation": incarnation,
        "incarnationStartTime": "2026-01-01T12:00:00Z",
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Running"},
            {"type": "Restarting", "status": "False", "reason": "Running"},
        ],
        **fields,
    }


def condition(result: Any, kind: str) -> tuple[str, str, str]:
    """The one condition ``kind`` of a reconcile result: (status, reason, message)."""
    found = [c for c in result.status.conditions if c.type == kind]
    assert len(found) == 1, kind
    return found[0].status.value, found[0].reason, found[0].message


def cond(result: Any, kind: str) -> tuple[str, str]:
    """The condition ``kind`` of a reconcile result as the tables compare it: (status, reason)."""
    return condition(result, kind)[:2]


def verbs(result: Any) -> list[str]:
    """A reconcile result's actions as sorted text, e.g. ``"create Pod/demo-i1-gym-0"``."""
    return sorted(str(action) for action in result.actions)

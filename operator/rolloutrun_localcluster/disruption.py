"""PodDisruptionBudgets (policy/v1): the disruption controller's status and the check the
``pods/eviction`` subresource makes, as kube-controller-manager and the API server do them.

Why: the chart ships a PDB for the operator's replicas and ``kubectl drain`` (and every
autoscaler) evicts through ``pods/eviction``; a cluster that stored no PDB, or evicted past
one, would let a drain take down what the budget protects without anyone noticing here.

The rules, from ``pkg/controller/disruption`` and ``pkg/registry/core/pod/storage/eviction.go``:
a budget covers the pods of its namespace its selector matches (a null selector none, an
empty one every pod); a pod counts healthy when it is Ready, not being deleted and not in
``disruptedPods`` (evictions the controller has not yet seen through, for two minutes);
``minAvailable`` as a number wants that many of the matched pods, a percentage or
``maxUnavailable`` scales by the pods' controllers (``spec.replicas`` of each distinct
owner); ``disruptionsAllowed`` is healthy minus desired, never below zero. An eviction of a
Pending, Succeeded, Failed or terminating pod, or of a pod no budget covers, deletes it; of an
unready pod, when the budget is met (or its ``unhealthyPodEvictionPolicy`` is
``AlwaysAllow``); otherwise it takes one allowed disruption (recorded in ``disruptedPods``)
or is refused: 429 ``TooManyRequests`` "Cannot evict pod as it would violate the pod's
disruption budget." with a ``DisruptionBudget`` cause, which ``kubectl drain`` retries. An
eviction that goes ahead first writes ``DisruptionTarget=True`` (``EvictionByEvictionAPI``)
on the pod, then deletes it.
Pure functions here; controllers.py and server.py call them with what the store holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from . import errors
from .selectors import labels_match, selector_from_label_selector
from .store import rfc3339
from .table_printers import parse_time

Obj = dict[str, Any]
#: How long an eviction keeps its pod out of the healthy count (the controller's DeletionTimeout).
DELETION_TIMEOUT = timedelta(minutes=2)
#: More unconfirmed evictions than this and the API refuses another (MaxDisruptedPodSize).
MAX_DISRUPTED_PODS = 2000
STORAGE_KEY = "poddisruptionbudgets.policy"
CONDITION = "DisruptionAllowed"
#: The pod condition an eviction (and every other disruption Kubernetes makes) writes.
DISRUPTION_TARGET = "DisruptionTarget"
REFUSED = "Cannot evict pod as it would violate the pod's disruption budget."
#: The owners whose ``spec.replicas`` say how many pods a budget expects.
SCALED_KINDS = frozenset({"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"})


def covers(pdb: Obj, pod: Obj) -> bool:
    """Whether the budget's selector matches the pod (same namespace)."""
    if pdb["metadata"].get("namespace") != pod["metadata"].get("namespace"):
        return False
    try:
        requirements = selector_from_label_selector((pdb.get("spec") or {}).get("selector"))
    except errors.ApiError:
        return False
    if requirements is None:
        return False
    return labels_match(requirements, pod["metadata"].get("labels"))


def is_ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def scaled(value: int | str, total: int, round_up: bool) -> int:
    """``intstr.GetScaledValueFromIntOrPercent``: a number as is, ``"50%"`` of ``total``."""
    if isinstance(value, int):
        return value
    if not value.endswith("%") or not value[:-1].isdigit():
        raise ValueError(f"invalid value for IntOrString: invalid value {value!r}")
    share = int(value[:-1]) * total
    return -(-share // 100) if round_up else share // 100


def expected_scale(pods: list[Obj], owner: Callable[[str], Obj | None]) -> int:
    """The replicas the pods' distinct controllers want (``owner`` finds an object by uid);
    a ReplicaSet a Deployment controls counts as the Deployment."""
    wanted: dict[str, int] = {}
    for pod in pods:
        ref = next(
            (r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), None
        )
        if ref is None:
            raise ValueError(f'found no controller ref for pod "{pod["metadata"]["name"]}"')
        controller = owner(ref.get("uid", "")) if ref.get("kind") in SCALED_KINDS else None
        if controller is not None and controller.get("kind") == "ReplicaSet":
            parent = next(
                (
                    r
                    for r in controller["metadata"].get("ownerReferences") or []
                    if r.get("controller")
                ),
                None,
            )
            if parent is not None and parent.get("kind") == "Deployment":
                controller = owner(parent.get("uid", "")) or controller
        if controller is None:
            raise ValueError(f'found no controllers for pod "{pod["metadata"]["name"]}"')
        replicas = (controller.get("spec") or {}).get("replicas", 1)
        wanted[controller["metadata"]["uid"]] = int(replicas)
    return sum(wanted.values())


def expected_and_desired(
    spec: Obj, pods: list[Obj], owner: Callable[[str], Obj | None]
) -> tuple[int, int]:
    """(expectedPods, desiredHealthy) of a budget; ValueError says why they cannot be known."""
    max_unavailable, min_available = spec.get("maxUnavailable"), spec.get("minAvailable")
    if max_unavailable is not None:
        expected = expected_scale(pods, owner)
        return expected, max(expected - scaled(max_unavailable, expected, True), 0)
    if isinstance(min_available, int):
        return len(pods), min_available
    if min_available is not None:
        expected = expected_scale(pods, owner)
        return expected, scaled(min_available, expected, True)
    return 0, 0


def still_disrupted(status: Obj, pods: list[Obj], now: datetime) -> dict[str, str]:
    """``disruptedPods`` less the pods now being deleted, gone, or evicted too long ago."""
    recorded = status.get("disruptedPods") or {}
    kept: dict[str, str] = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        when = parse_time(recorded.get(name))
        if pod["metadata"].get("deletionTimestamp") or when is None:
            continue
        if when + DELETION_TIMEOUT >= now:
            kept[name] = recorded[name]
    return kept


def next_expiry(status: Obj, now: datetime) -> float | None:
    """Seconds until the first ``disruptedPods`` entry expires (the controller looks again
    then, as it requeues a budget), None without entries."""
    moments = [parse_time(t) for t in (status.get("disruptedPods") or {}).values()]
    waits = [(m + DELETION_TIMEOUT - now).total_seconds() for m in moments if m is not None]
    return max(min(waits), 0.0) if waits else None


def healthy(pods: list[Obj], disrupted: dict[str, str], now: datetime) -> int:
    count = 0
    for pod in pods:
        when = parse_time(disrupted.get(pod["metadata"]["name"]))
        if pod["metadata"].get("deletionTimestamp") or (when and when + DELETION_TIMEOUT > now):
            continue
        count += is_ready(pod)
    return count


def condition(
    old: list[Obj], status: str, reason: str, message: str, generation: int, now: datetime
) -> list[Obj]:
    """The ``DisruptionAllowed`` condition, its transition time kept while its status is."""
    previous = next((c for c in old if c.get("type") == CONDITION), None)
    moment = rfc3339(now)
    if previous is not None and previous.get("status") == status:
        moment = previous.get("lastTransitionTime", moment)
    return [
        *(c for c in old if c.get("type") != CONDITION),
        {
            "type": CONDITION,
            "status": status,
            "observedGeneration": generation,
            "lastTransitionTime": moment,
            "reason": reason,
            "message": message,
        },
    ]


def allowed_condition(allowed: int) -> tuple[str, str]:
    return ("True", "SufficientPods") if allowed > 0 else ("False", "InsufficientPods")


def budget_status(
    pdb: Obj, pods: Iterable[Obj], owner: Callable[[str], Obj | None], now: datetime
) -> Obj:
    """The status the disruption controller writes for ``pdb`` given every pod in the cluster."""
    matched = [pod for pod in pods if covers(pdb, pod)]
    old = pdb.get("status") or {}
    generation = int(pdb["metadata"].get("generation", 1))
    conditions = old.get("conditions") or []
    disrupted = still_disrupted(old, matched, now)
    current = healthy(matched, disrupted, now)
    try:
        expected, desired = expected_and_desired(pdb.get("spec") or {}, matched, owner)
    except ValueError as error:  # the controller's failSafe: nothing may be disrupted
        status = {**old, "disruptionsAllowed": 0, "observedGeneration": generation}
        status["conditions"] = condition(
            conditions, "False", "SyncFailed", str(error), generation, now
        )
        return status
    allowed = current - desired if expected > 0 and current > desired else 0
    status = {
        "observedGeneration": generation,
        "disruptionsAllowed": allowed,
        "currentHealthy": current,
        "desiredHealthy": desired,
        "expectedPods": expected,
        "conditions": condition(conditions, *allowed_condition(allowed), "", generation, now),
    }
    if disrupted:
        status["disruptedPods"] = disrupted
    return status


@dataclass(frozen=True)
class EvictionVerdict:
    """What an eviction does: delete the pod, first writing ``status`` to ``budget`` if set."""

    budget: Obj | None = None
    status: Obj | None = None


def can_ignore_budgets(pod: Obj) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Pending", "Succeeded", "Failed") or bool(
        pod["metadata"].get("deletionTimestamp")
    )


def _too_many_requests(cause: str, retry_after: int) -> errors.ApiError:
    details: Obj = {"causes": [{"reason": "DisruptionBudget", "message": cause}]}
    if retry_after:
        details["retryAfterSeconds"] = retry_after
    return errors.ApiError(429, "TooManyRequests", REFUSED, details)


def _forbidden(name: str, why: str) -> errors.ApiError:
    return errors.ApiError(
        403,
        "Forbidden",
        f'poddisruptionbudgets.policy "{name}" is forbidden: {why}',
        {"name": name, "group": "policy", "kind": "poddisruptionbudgets"},
    )


def evicting_status(pod: Obj, now: datetime) -> Obj:
    """The pod's status as an eviction writes it before the delete: ``DisruptionTarget=True``
    (``EvictionByEvictionAPI``), so whoever sees the pod go knows an eviction took it (a
    drain, an autoscaler), not a plain delete."""
    return disruption_target(
        dict(pod.get("status") or {}), "EvictionByEvictionAPI", "Eviction API: evicting", now
    )


def disruption_target(status: Obj, reason: str, message: str, now: datetime) -> Obj:
    """``status`` with ``DisruptionTarget=True`` for ``reason`` (what a controller writes on a
    pod it is about to delete), the condition's transition time kept if it said so already."""
    old = list(status.get("conditions") or [])
    previous = next((c for c in old if c.get("type") == DISRUPTION_TARGET), None)
    moment = rfc3339(now)
    if previous is not None and previous.get("status") == "True":
        moment = previous.get("lastTransitionTime", moment)
    target = {
        "type": DISRUPTION_TARGET,
        "status": "True",
        "lastTransitionTime": moment,
        "reason": reason,
        "message": message,
    }
    return {
        **status,
        "conditions": [*(c for c in old if c.get("type") != DISRUPTION_TARGET), target],
    }


def preconditions_hold(pod: Obj, options: Obj) -> bool:
    """Whether the delete options' preconditions (uid, resourceVersion) name this pod as it
    is: only then does the eviction write its condition (else the delete refuses: 409)."""
    wanted = options.get("preconditions") or {}
    meta = pod["metadata"]
    return all(
        not wanted.get(key) or wanted[key] == meta.get(key) for key in ("uid", "resourceVersion")
    )


def after_own_write(options: Obj, pod: Obj) -> Obj:
    """Delete options whose resourceVersion precondition follows the eviction's own status
    write (as the API server moves it on), so that write does not refuse the delete."""
    wanted = options.get("preconditions") or {}
    if not wanted.get("resourceVersion"):
        return options
    fresh = pod["metadata"]["resourceVersion"]
    return {**options, "preconditions": {**wanted, "resourceVersion": fresh}}


def evict(pod: Obj, budgets: Iterable[Obj], now: datetime) -> EvictionVerdict:
    """The eviction subresource's decision; raises the API error that refuses it."""
    if can_ignore_budgets(pod):
        return EvictionVerdict()
    covering = [pdb for pdb in budgets if covers(pdb, pod)]
    if len(covering) > 1:
        raise errors.ApiError(
            500,
            "InternalError",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource "
            "does not support.",
        )
    if not covering:
        return EvictionVerdict()
    pdb = covering[0]
    name, status = pdb["metadata"]["name"], dict(pdb.get("status") or {})
    current, desired = status.get("currentHealthy", 0), status.get("desiredHealthy", 0)
    if not is_ready(pod):
        policy = (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy")
        if policy == "AlwaysAllow" or (current >= desired and desired > 0):
            return EvictionVerdict()
    if status.get("observedGeneration", 0) < pdb["metadata"].get("generation", 1):
        raise _too_many_requests(
            f"The disruption budget {name} is still being processed by the server.", 10
        )
    allowed = status.get("disruptionsAllowed", 0)
    if allowed < 0:
        raise _forbidden(name, "pdb disruptions allowed is negative")
    if len(status.get("disruptedPods") or {}) > MAX_DISRUPTED_PODS:
        raise _forbidden(
            name, "DisruptedPods map too big - too many evictions not confirmed by PDB controller"
        )
    if allowed == 0:
        raise _too_many_requests(
            f"The disruption budget {name} needs {desired} healthy pods and has {current} "
            "currently",
            0,
        )
    status["disruptionsAllowed"] = allowed - 1
    if allowed == 1:
        generation = int(pdb["metadata"].get("generation", 1))
        status["conditions"] = condition(
            status.get("conditions") or [], "False", "InsufficientPods", "", generation, now
        )
    status["disruptedPods"] = {
        **(status.get("disruptedPods") or {}),
        pod["metadata"]["name"]: rfc3339(now),
    }
    return EvictionVerdict(pdb, status)

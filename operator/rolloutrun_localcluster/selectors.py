"""Label and field selectors: parsing and matching, as pure functions.

Lists, watches, Services and the garbage collector all select objects the same way the real
API server does, so a selector that works here works on a cluster and one the server would
reject (an unsupported field label, a malformed requirement) is rejected here with a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import labelparse
from .errors import ApiError, bad_request


@dataclass(frozen=True)
class Requirement:
    """One clause of a label selector: ``key op values``."""

    key: str
    op: str  # "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!":
            return self.key not in labels
        if self.op == "in":
            return self.key in labels and labels[self.key] in self.values
        if self.op in ("gt", "lt"):
            return _compare(labels.get(self.key), self.op, self.values)
        # notin: a missing key matches, as on the real server.
        return self.key not in labels or labels[self.key] not in self.values


def _compare(label: str | None, op: str, values: tuple[str, ...]) -> bool:
    """``key>3`` / ``key<3``: the label exists and both sides are integers."""
    try:
        have, bound = int(label or ""), int(values[0])
    except (ValueError, IndexError):
        return False
    return have > bound if op == "gt" else have < bound


def parse_label_selector(selector: str | None) -> list[Requirement]:
    """Parse ``a=b,c!=d,e in (f,g),!h,i,j>3`` into requirements, by the real server's grammar
    (:mod:`.labelparse`); a selector it refuses is a 400 with its message."""
    if not selector or not selector.strip():
        return []
    try:
        parsed = labelparse.parse(selector)
    except labelparse.SelectorError as error:
        raise bad_request(str(error)) from None
    ops = {"=": "in", "==": "in", "!=": "notin"}
    return [Requirement(key, ops.get(op, op), values) for key, op, values in parsed]


def labels_match(requirements: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    return all(requirement.matches(labels) for requirement in requirements)


def selector_from_label_selector(spec: Mapping[str, Any] | None) -> list[Requirement] | None:
    """A ``metav1.LabelSelector`` (matchLabels + matchExpressions) as requirements.

    ``None`` selects nothing, an empty selector selects everything (API conventions)."""
    if spec is None:
        return None
    requirements = [
        Requirement(key, "in", (str(value),))
        for key, value in (spec.get("matchLabels") or {}).items()
    ]
    operators = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expression in spec.get("matchExpressions") or []:
        op = operators.get(expression.get("operator", ""))
        if op is None:
            raise bad_request(
                f"{expression.get('operator')!r} is not a valid label selector operator"
            )
        requirements.append(
            Requirement(expression["key"], op, tuple(expression.get("values") or ()))
        )
    return requirements


# Field labels the real server accepts per resource; every resource accepts these two.
COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
FIELD_LABELS: dict[str, frozenset[str]] = {
    "pods": frozenset(
        {
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
    "events": frozenset(
        {
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        }
    ),
    "secrets": frozenset({"type"}),
    "namespaces": frozenset({"status.phase"}),
    "nodes": frozenset({"spec.unschedulable"}),
    "replicationcontrollers": frozenset({"status.replicas"}),
}


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    equal: bool
    value: str


def parse_field_selector(selector: str | None, plural: str) -> list[FieldRequirement]:
    """Parse ``metadata.name=x,status.phase!=Running``; unknown field labels are a 400."""
    if not selector or not selector.strip():
        return []
    allowed = COMMON_FIELDS | FIELD_LABELS.get(plural, frozenset())
    requirements: list[FieldRequirement] = []
    for clause in selector.split(","):
        clause = clause.strip()
        if not clause:
            continue
        for op in ("!=", "==", "="):
            if op in clause:
                field, value = clause.split(op, 1)
                break
        else:
            raise bad_request(f"invalid selector: '{selector}'; can't understand '{clause}'")
        field = field.strip()
        if field not in allowed:
            raise ApiError(
                400,
                "BadRequest",
                f"field label not supported: {field}",
            )
        requirements.append(FieldRequirement(field, op != "!=", value.strip()))
    return requirements


def field_value(obj: Mapping[str, Any], field: str) -> str:
    """The string the server compares a field selector with (missing fields are ``""``)."""
    if field == "source" and "source" in obj:
        return str((obj.get("source") or {}).get("component", ""))
    current: Any = obj
    for part in field.split("."):
        if not isinstance(current, Mapping):
            return ""
        current = current.get(part)
    if current is None:
        return ""
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


def fields_match(requirements: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, r.field) == r.value) == r.equal for r in requirements)

"""Names, labels, annotations, selectors and container fields checked as the API server does.

Why: where the local cluster is kinder than a real one, bugs hide (a run named ``7b-grpo``
worked here while a real server refused its Service ``7b-grpo-trainer`` forever). So every
object written is checked by the real server's rules for its kind, and a refusal is the real
422 ``Invalid`` with the real causes and texts: the name by its kind's rule (DNS-1035 label
for Services, DNS-1123 label for Namespaces, path segment for RBAC objects, DNS-1123
subdomain for everything else, ``generateName`` likewise with its trailing '-' masked),
label keys and values, annotation keys and their total size, finalizers, label selectors
inside specs (Service ``selector``, NetworkPolicy selectors), and the container fields the
operator builds (container names, port names, env var names).

The string rules and their messages are :mod:`rolloutrun_operator.kube_names` (shared with
the operator's own early checks); this module only says which rule applies to which field
and spells each failure as apimachinery's ``field.Error`` does. Pure functions returning
``(reason, field, "field: body")`` causes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rolloutrun_operator import kube_names

Obj = dict[str, Any]
Cause = tuple[str, str, str]
NameRule = Callable[[str], list[str]]

INVALID = "FieldValueInvalid"
REQUIRED = "FieldValueRequired"

# metadata.name by kind (storage key); every other kind is a DNS-1123 subdomain.
_NAME_RULES: dict[str, NameRule] = {
    "services": kube_names.is_dns1035_label,
    "namespaces": kube_names.is_dns1123_label,
    "roles.rbac.authorization.k8s.io": kube_names.is_path_segment_name,
    "rolebindings.rbac.authorization.k8s.io": kube_names.is_path_segment_name,
    "clusterroles.rbac.authorization.k8s.io": kube_names.is_path_segment_name,
    "clusterrolebindings.rbac.authorization.k8s.io": kube_names.is_path_segment_name,
}


def go_quote(value: str) -> str:
    """A string as Go's ``%q`` prints it (the value in ``Invalid value: "…"``)."""
    out = []
    for char in value:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif not char.isprintable():
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def invalid(field: str, value: str, detail: str) -> Cause:
    return (INVALID, field, f"{field}: Invalid value: {go_quote(value)}: {detail}")


def required(field: str, detail: str = "") -> Cause:
    return (REQUIRED, field, f"{field}: Required value" + (f": {detail}" if detail else ""))


def name_rule(storage_key: str) -> NameRule:
    return _NAME_RULES.get(storage_key, kube_names.is_dns1123_subdomain)


def name_causes(storage_key: str, meta: Mapping[str, Any]) -> list[Cause]:
    """``metadata.name`` and ``metadata.generateName`` by the kind's rule."""
    rule = name_rule(storage_key)
    causes = []
    generate = meta.get("generateName") or ""
    if generate:
        masked = kube_names.mask_trailing_dash(generate)
        if rule is kube_names.is_path_segment_name:
            masked = generate
        causes += [invalid("metadata.generateName", generate, m) for m in rule(masked)]
    name = meta.get("name") or ""
    if not name:
        return [*causes, required("metadata.name", "name or generateName is required")]
    return causes + [invalid("metadata.name", name, message) for message in rule(name)]


def labels_causes(labels: Any, field: str) -> list[Cause]:
    """apimachinery's ``ValidateLabels``: the field is the map's (no key index)."""
    causes: list[Cause] = []
    for key, value in _string_map(labels):
        causes += [invalid(field, key, message) for message in kube_names.is_qualified_name(key)]
        causes += [invalid(field, value, message) for message in kube_names.is_label_value(value)]
    return causes


def annotations_causes(annotations: Any, field: str = "metadata.annotations") -> list[Cause]:
    causes: list[Cause] = []
    total = 0
    for key, value in _string_map(annotations):
        total += len(key.encode()) + len(value.encode())
        problems = kube_names.is_qualified_name(key.lower())
        causes += [invalid(field, key, message) for message in problems]
    if total > kube_names.TOTAL_ANNOTATION_SIZE:
        limit = kube_names.TOTAL_ANNOTATION_SIZE
        causes.append(
            ("FieldValueTooLong", field, f"{field}: Too long: may not be more than {limit} bytes")
        )
    return causes


def meta_causes(storage_key: str, obj: Obj, old: Obj | None) -> list[Cause]:
    """Every object's metadata: the name (on create), labels, annotations, finalizers."""
    meta = obj.get("metadata") or {}
    causes = name_causes(storage_key, meta) if old is None else []
    causes += labels_causes(meta.get("labels"), "metadata.labels")
    causes += annotations_causes(meta.get("annotations"))
    for finalizer in meta.get("finalizers") or []:
        if isinstance(finalizer, str):
            causes += [
                invalid("metadata.finalizers", finalizer, message)
                for message in kube_names.is_qualified_name(finalizer)
            ]
    return causes


def label_selector_causes(selector: Any, field: str) -> list[Cause]:
    """A ``metav1.LabelSelector`` (matchLabels and matchExpressions) in a spec."""
    if not isinstance(selector, Mapping):
        return []
    causes = labels_causes(selector.get("matchLabels"), f"{field}.matchLabels")
    for index, expression in enumerate(selector.get("matchExpressions") or []):
        if isinstance(expression, Mapping):
            causes += _expression_causes(expression, f"{field}.matchExpressions[{index}]")
    return causes


def _expression_causes(expression: Mapping[str, Any], where: str) -> list[Cause]:
    causes: list[Cause] = []
    operator = expression.get("operator")
    values = [str(value) for value in expression.get("values") or []]
    if operator in ("In", "NotIn"):
        if not values:
            causes.append(
                required(f"{where}.values", "must be specified when `operator` is 'In' or 'NotIn'")
            )
    elif operator in ("Exists", "DoesNotExist"):
        if values:
            text = (
                f"{where}.values: Forbidden: may not be specified when `operator` is 'Exists' "
                "or 'DoesNotExist'"
            )
            causes.append(("FieldValueForbidden", f"{where}.values", text))
    else:
        causes.append(invalid(f"{where}.operator", str(operator), "not a valid selector operator"))
    key = str(expression.get("key") or "")
    causes += [invalid(f"{where}.key", key, m) for m in kube_names.is_qualified_name(key)]
    for index, value in enumerate(values):
        field = f"{where}.values[{index}]"
        causes += [invalid(field, value, m) for m in kube_names.is_label_value(value)]
    return causes


def service_causes(spec: Mapping[str, Any]) -> list[Cause]:
    """A Service's selector (a plain label map) and port names (DNS-1123 labels)."""
    causes = labels_causes(spec.get("selector"), "spec.selector")
    ports = [port for port in spec.get("ports") or [] if isinstance(port, Mapping)]
    for index, port in enumerate(ports):
        field = f"spec.ports[{index}].name"
        name = str(port.get("name") or "")
        if not name and len(ports) > 1:
            causes.append(required(field))
        elif name:
            causes += [invalid(field, name, m) for m in kube_names.is_dns1123_label(name)]
    return causes


def container_causes(container: Mapping[str, Any], where: str) -> list[Cause]:
    """One container's name (DNS-1123 label), port names (IANA_SVC_NAME), env var names."""
    causes: list[Cause] = []
    name = str(container.get("name") or "")
    if not name:
        causes.append(required(f"{where}.name"))
    else:
        causes += [invalid(f"{where}.name", name, m) for m in kube_names.is_dns1123_label(name)]
    for index, port in enumerate(container.get("ports") or []):
        port_name = str(port.get("name") or "") if isinstance(port, Mapping) else ""
        if port_name:
            field = f"{where}.ports[{index}].name"
            causes += [invalid(field, port_name, m) for m in kube_names.is_port_name(port_name)]
    for index, variable in enumerate(container.get("env") or []):
        env_name = str(variable.get("name") or "") if isinstance(variable, Mapping) else ""
        field = f"{where}.env[{index}].name"
        if not env_name:
            causes.append(required(field))
        causes += [invalid(field, env_name, m) for m in kube_names.is_env_var_name(env_name)]
    return causes


def pod_spec_causes(spec: Mapping[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    for kind in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(kind) or []):
            if isinstance(container, Mapping):
                causes += container_causes(container, f"spec.{kind}[{index}]")
    return causes


def network_policy_causes(spec: Mapping[str, Any]) -> list[Cause]:
    causes = label_selector_causes(spec.get("podSelector"), "spec.podSelector")
    for direction, peers in (("ingress", "from"), ("egress", "to")):
        for index, rule in enumerate(spec.get(direction) or []):
            for peer_index, peer in enumerate((rule or {}).get(peers) or []):
                where = f"spec.{direction}[{index}].{peers}[{peer_index}]"
                for selector in ("podSelector", "namespaceSelector"):
                    causes += label_selector_causes(
                        (peer or {}).get(selector), f"{where}.{selector}"
                    )
    return causes


def disruption_budget_causes(spec: Mapping[str, Any]) -> list[Cause]:
    """A PodDisruptionBudget's spec: one of minAvailable and maxUnavailable, a known
    unhealthyPodEvictionPolicy, a valid selector."""
    causes = label_selector_causes(spec.get("selector"), "spec.selector")
    if spec.get("minAvailable") is not None and spec.get("maxUnavailable") is not None:
        causes.append(
            (
                "FieldValueInvalid",
                "spec",
                'spec: Invalid value: "": minAvailable and maxUnavailable cannot be both set',
            )
        )
    policy = spec.get("unhealthyPodEvictionPolicy")
    if policy is not None and policy not in ("IfHealthyBudget", "AlwaysAllow"):
        causes.append(
            (
                "FieldValueNotSupported",
                "spec.unhealthyPodEvictionPolicy",
                f'spec.unhealthyPodEvictionPolicy: Unsupported value: "{policy}": supported '
                'values: "AlwaysAllow", "IfHealthyBudget"',
            )
        )
    return causes


_SPEC_RULES: dict[str, Callable[[Mapping[str, Any]], list[Cause]]] = {
    "services": service_causes,
    "pods": pod_spec_causes,
    "networkpolicies.networking.k8s.io": network_policy_causes,
    "poddisruptionbudgets.policy": disruption_budget_causes,
}


def object_causes(storage_key: str, obj: Obj, old: Obj | None) -> list[Cause]:
    """Everything this module checks on one object about to be stored."""
    causes = meta_causes(storage_key, obj, old)
    spec = obj.get("spec")
    rule = _SPEC_RULES.get(storage_key)
    if rule is not None and isinstance(spec, Mapping):
        causes += rule(spec)
    return causes


def _string_map(value: Any) -> Iterable[tuple[str, str]]:
    if not isinstance(value, Mapping):
        return []
    return [(str(k), "" if v is None else str(v)) for k, v in value.items()]

"""A CRD's CEL rules (``x-kubernetes-validations``), evaluated as the API server does.

Why: rules across fields (``dModel`` divisible by ``nHeads``, ``file://`` storage with a
claim) live in the RolloutRun CRD as CEL, and a real API server refuses a violating object at
admission with a 422 naming the field and the rule's message. This module walks an object
(already defaulted, as the API server's rules see it) alongside its schema, evaluates every
rule with ``self`` bound to the object at that node, and answers the causes with the API
server's wording (``spec.run.policy: Invalid value: "object": <message>``).

It needs cel-python (``celpy``, in the ``test`` extra); :func:`available` says whether it is
importable. Not emulated: ``oldSelf`` (transition rules), ``messageExpression``, the cost
budget, and the Kubernetes CEL libraries beyond what cel-python implements.
"""

from __future__ import annotations

import functools
import json
from typing import Any

Cause = tuple[str, str, str]  # (reason, field, message), as rolloutrun_localcluster.schema


def available() -> bool:
    """Whether cel-python is importable (the rules can be evaluated)."""
    try:
        import celpy  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def evaluate(rule: str, value: Any) -> bool | str:
    """``rule`` with ``self`` bound to ``value``: True, False, or the evaluation error.

    Remembered by the value's JSON: a rule is a pure function of its value, and most writes
    of an object (its status, every few seconds at scale) leave the values its rules see
    unchanged, while interpreting a rule costs milliseconds."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return _evaluate(rule, value)
    return _remembered(rule, text)


@functools.lru_cache(maxsize=4096)
def _remembered(rule: str, text: str) -> bool | str:
    return _evaluate(rule, json.loads(text))


def _evaluate(rule: str, value: Any) -> bool | str:
    import celpy

    try:
        result = _program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except Exception as error:  # a compile or evaluation error is the answer
        return f"{error}"
    if isinstance(result, Exception):
        return f"{result}"
    return bool(result)


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _cause(path: str, value: Any, entry: dict[str, Any], failed: bool | str) -> Cause:
    field = path + entry.get("fieldPath", "") if entry.get("fieldPath") else path
    field = field.lstrip(".") or "<root>"
    message = entry.get("message") or f"failed rule: {entry['rule']}"
    if isinstance(failed, str):
        message = f"{failed} evaluating rule: {entry['rule']}"
    reason = entry.get("reason") or "FieldValueInvalid"
    if reason == "FieldValueRequired":
        return (reason, field, f"{field}: Required value: {message}")
    if reason == "FieldValueForbidden":
        return (reason, field, f"{field}: Forbidden: {message}")
    return (reason, field, f'{field}: Invalid value: "{_kind(value)}": {message}')


def rule_causes(value: Any, schema: dict[str, Any], path: str = "") -> list[Cause]:
    """Every rule of ``schema`` (and of its properties and items) that ``value`` breaks."""
    if value is None:
        return []
    causes: list[Cause] = []
    for entry in schema.get("x-kubernetes-validations") or []:
        result = evaluate(entry["rule"], value)
        if result is not True:
            causes.append(_cause(path, value, entry, result))
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            child = properties.get(key, additional if isinstance(additional, dict) else None)
            if isinstance(child, dict) and not (not path and key == "metadata"):
                causes += rule_causes(item, child, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            causes += rule_causes(item, schema["items"], f"{path}[{index}]")
    return causes

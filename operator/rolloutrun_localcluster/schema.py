"""Custom resources against their CRD's ``openAPIV3Schema``: prune, default, validate.

The real API server does these three steps in this order for every write of a custom
resource, and answers a violation with a 422 whose causes name the field with the wording of
kube-openapi (``spec.replicas: Invalid value: -1: spec.replicas in body should be greater
than or equal to 0``). Unknown fields are pruned (and reported as a ``Warning`` header);
with ``fieldValidation=Strict`` they are a 400 "strict decoding error", as real.

CEL rules (``x-kubernetes-validations``) are evaluated after these checks pass by
:mod:`.cel` when cel-python is importable (the ``test`` extra), else not at all. Not
emulated: ``format`` checks beyond integers, ``oneOf``/``anyOf``/``not`` (structural schemas
use them only for validation; ignored).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

Cause = tuple[str, str, str]  # (reason, field, message)

_META_KEYS = ("apiVersion", "kind", "metadata")


def _show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return True


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def prune(value: Any, schema: dict[str, Any], path: str = "") -> tuple[Any, list[str]]:
    """Drop fields the schema does not declare; return the pruned value and their paths."""
    dropped: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
        return value, dropped
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        result: dict[str, Any] = {}
        for key, item in value.items():
            if not path and key in _META_KEYS:
                result[key] = item
            elif properties is not None and key in properties:
                result[key], more = prune(item, properties[key], _join(path, key))
                dropped += more
            elif isinstance(additional, dict):
                result[key], more = prune(item, additional, _join(path, key))
                dropped += more
            elif additional is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                result[key] = item
            else:
                dropped.append(_join(path, key))
        return result, dropped
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        items: list[Any] = []
        for index, item in enumerate(value):
            pruned, more = prune(item, schema["items"], f"{path}[{index}]")
            items.append(pruned)
            dropped += more
        return items, dropped
    return value, dropped


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill ``default`` values of absent properties, recursively (structural defaulting).

    A ``null`` where the schema is not ``nullable`` counts as absent, as on the real server:
    it takes the default, or is pruned without one (what a template leaves as ``key:``)."""
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for key, sub in properties.items():
            if key in value and value[key] is None and not sub.get("nullable"):
                del value[key]
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value and value[key] is not None:
                value[key] = apply_defaults(value[key], sub)
        additional = schema.get("additionalProperties")
        if isinstance(additional, dict):
            for key in list(value):
                if key in properties:
                    continue
                if value[key] is None and not additional.get("nullable"):
                    del value[key]
                else:
                    value[key] = apply_defaults(value[key], additional)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[Cause]:
    """Every violation of ``schema`` in ``value`` as ``(reason, field, message)``."""
    causes: list[Cause] = []
    shown = path or "<root>"
    if value is None:
        if schema.get("nullable"):
            return causes
        kind = schema.get("type")
        if kind:
            message = (
                f'{shown}: Invalid value: "null": {shown} in body must be of type {kind}: "null"'
            )
            return [("FieldValueTypeInvalid", shown, message)]
        return causes
    if schema.get("x-kubernetes-int-or-string"):
        if not (isinstance(value, str) or _type_ok("integer", value)):
            got = type(value).__name__
            message = (
                f'{shown}: Invalid value: "{got}": {shown} in body must be of type int-or-string'
            )
            causes.append(("FieldValueTypeInvalid", shown, message))
        return causes
    kind = schema.get("type")
    if kind and not _type_ok(kind, value):
        actual = {
            dict: "object",
            list: "array",
            str: "string",
            bool: "boolean",
            int: "integer",
            float: "number",
        }
        got = actual.get(type(value), type(value).__name__)
        message = (
            f'{shown}: Invalid value: "{got}": {shown} in body must be of type {kind}: "{got}"'
        )
        return [("FieldValueTypeInvalid", shown, message)]
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_show(v) for v in schema["enum"])
        message = f"{shown}: Unsupported value: {_show(value)}: supported values: {supported}"
        causes.append(("FieldValueNotSupported", shown, message))
    causes += _bounds(value, schema, shown)
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                field = _join(path, key)
                causes.append(("FieldValueRequired", field, f"{field}: Required value"))
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            if not path and key in _META_KEYS:
                continue
            if key in properties:
                causes += validate(item, properties[key], _join(path, key))
            elif isinstance(additional, dict):
                causes += validate(item, additional, _join(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            causes += validate(item, schema["items"], f"{path}[{index}]")
    return causes


def _bounds(value: Any, schema: dict[str, Any], shown: str) -> list[Cause]:
    causes: list[Cause] = []

    def bad(detail: str) -> None:
        message = f"{shown}: Invalid value: {_show(value)}: {shown} in body {detail}"
        causes.append(("FieldValueInvalid", shown, message))

    def too_many(actual: int, limit: int) -> None:
        message = f"{shown}: Too many: {actual}: must have at most {limit} items"
        causes.append(("FieldValueTooMany", shown, message))

    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema:
            limit = schema["minimum"]
            if schema.get("exclusiveMinimum") and value <= limit:
                bad(f"should be greater than {limit}")
            elif value < limit:
                bad(f"should be greater than or equal to {limit}")
        if "maximum" in schema:
            limit = schema["maximum"]
            if schema.get("exclusiveMaximum") and value >= limit:
                bad(f"should be less than {limit}")
            elif value > limit:
                bad(f"should be less than or equal to {limit}")
        if "multipleOf" in schema and schema["multipleOf"] and value % schema["multipleOf"]:
            bad(f"should be a multiple of {schema['multipleOf']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            bad(f"should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value.encode()) > schema["maxLength"]:
            message = f"{shown}: Too long: may not be more than {schema['maxLength']} bytes"
            causes.append(("FieldValueTooLong", shown, message))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            bad(f"should match '{schema['pattern']}'")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            bad(f"should have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            too_many(len(value), schema["maxItems"])
        if schema.get("uniqueItems") or schema.get("x-kubernetes-list-type") == "set":
            seen: list[Any] = []
            for item in value:
                if item in seen:
                    message = f"{shown}: Duplicate value: {_show(item)}"
                    causes.append(("FieldValueDuplicate", shown, message))
                seen.append(item)
    if isinstance(value, dict):
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            bad(f"should have at least {schema['minProperties']} properties")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            too_many(len(value), schema["maxProperties"])
    return causes

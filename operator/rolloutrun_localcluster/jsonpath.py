"""The JSONPath subset of Kubernetes printer columns, evaluated as the API server does.

A CRD's ``additionalPrinterColumns`` name their values by JSONPath, and the real server
evaluates them with client-go's ``jsonpath`` package (missing keys allowed, the first result
used): ``.status.trainStep``, ``.spec.ports[0].port``, ``.items[*].name``,
``..name`` and filters such as ``.status.conditions[?(@.type=="Ready")].status``. A renderer
that only walks plain fields leaves the filtered columns empty (``kubectl get rr`` printed no
Ready or Reason), so the path is parsed here into steps and evaluated over lists of matches.

Supported: ``.field`` and ``['field']``, ``[n]`` (negative from the end), ``[a:b]``, ``[*]``
and ``.*``, ``..field`` (recursive descent), ``[?(@.path)]`` (exists) and
``[?(@.path OP literal)]`` with ``== != < <= > >=`` on strings, numbers, booleans. A path
outside this subset is refused with ``JsonPathError`` naming the position. Pure functions.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from typing import Any

ORDERINGS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_NAME = re.compile(r"[A-Za-z0-9_$\-/]+")
_FILTER = re.compile(
    r"\?\(\s*@(?P<path>[^=!<>]*?)\s*(?:(?P<op>==|!=|<=|>=|<|>)\s*(?P<rhs>.+?))?\s*\)$"
)


class JsonPathError(ValueError):
    """The path is not in the supported JSONPath subset."""


@dataclass(frozen=True)
class Step:
    """One step: ``field`` (name), ``index``, ``slice``, ``all`` (``*``), ``descend`` (``..``
    then name or all), ``filter`` (a sub-path from ``@``, an operator and a literal)."""

    kind: str
    name: str = ""
    index: int = 0
    stop: int | None = None
    sub: tuple[Step, ...] = ()
    op: str = ""
    literal: Any = None


def parse(path: str) -> tuple[Step, ...]:
    """``.status.conditions[?(@.type=="Ready")].status`` as steps; ``{...}`` braces allowed."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    steps: list[Step] = []
    pos = 0
    if text.startswith("$"):
        pos = 1
    while pos < len(text):
        if text.startswith("..", pos):
            pos += 2
            if text.startswith("*", pos):
                steps.append(Step("descend"))
                pos += 1
                continue
            name, pos = _name(text, pos, path)
            steps.append(Step("descend", name=name))
        elif text[pos] == ".":
            pos += 1
            if text.startswith("*", pos):
                steps.append(Step("all"))
                pos += 1
            elif pos < len(text) and text[pos] not in ".[":
                name, pos = _name(text, pos, path)
                steps.append(Step("field", name=name))
        elif text[pos] == "[":
            end = _closing_bracket(text, pos, path)
            steps.append(_bracket(text[pos + 1 : end].strip(), path))
            pos = end + 1
        elif not steps and pos == 0:
            name, pos = _name(text, pos, path)  # kubectl allows a leading bare name
            steps.append(Step("field", name=name))
        else:
            raise JsonPathError(f"unexpected {text[pos]!r} at {pos} in JSONPath {path!r}")
    return tuple(steps)


def _name(text: str, pos: int, path: str) -> tuple[str, int]:
    match = _NAME.match(text, pos)
    if match is None:
        raise JsonPathError(f"expected a field name at {pos} in JSONPath {path!r}")
    return match.group(), match.end()


def _closing_bracket(text: str, pos: int, path: str) -> int:
    depth, quote = 0, ""
    for i in range(pos, len(text)):
        char = text[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i
    raise JsonPathError(f"unclosed [ at {pos} in JSONPath {path!r}")


def _bracket(inner: str, path: str) -> Step:
    if inner == "*":
        return Step("all")
    if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
        return Step("field", name=inner[1:-1])
    if inner.startswith("?"):
        return _filter(inner, path)
    try:
        if ":" in inner:
            start, stop = (part.strip() for part in inner.split(":", 2)[:2])
            return Step("slice", index=int(start or 0), stop=int(stop) if stop else None)
        return Step("index", index=int(inner))
    except ValueError as error:
        raise JsonPathError(f"unsupported subscript [{inner}] in JSONPath {path!r}") from error


def _filter(inner: str, path: str) -> Step:
    match = _FILTER.match(inner)
    if match is None:
        raise JsonPathError(f"unsupported filter [{inner}] in JSONPath {path!r}")
    sub = parse(match["path"]) if match["path"].strip() else ()
    if match["op"] is None:
        return Step("filter", sub=sub)
    return Step("filter", sub=sub, op=match["op"], literal=_literal(match["rhs"], path))


def _literal(text: str, path: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    try:
        return json.loads(text)  # numbers, true, false, null
    except ValueError as error:
        raise JsonPathError(f"unsupported literal {text!r} in JSONPath {path!r}") from error


# ---------------------------------------------------------------------------- evaluation
def find(obj: Any, path: str | tuple[Step, ...]) -> list[Any]:
    """Every value the path reaches in ``obj`` (missing keys give no value, never an error)."""
    steps = parse(path) if isinstance(path, str) else path
    current = [obj]
    for step in steps:
        current = [found for value in current for found in _apply(step, value)]
    return current


def first(obj: Any, path: str | tuple[Step, ...]) -> Any:
    """The first value the path reaches, or None: what a printer column shows."""
    found = find(obj, path)
    return found[0] if found else None


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    return list(value) if isinstance(value, list) else []


def _apply(step: Step, value: Any) -> list[Any]:
    if step.kind == "field":
        return [value[step.name]] if isinstance(value, dict) and step.name in value else []
    if step.kind == "all":
        return _children(value)
    if step.kind == "descend":
        return _descend(step, value)
    if not isinstance(value, list):
        return []
    if step.kind == "index":
        return [value[step.index]] if -len(value) <= step.index < len(value) else []
    if step.kind == "slice":
        return value[step.index : step.stop]
    return [item for item in value if _matches(step, item)]


def _descend(step: Step, value: Any) -> list[Any]:
    """``..name``: the value itself and every object under it, in document order."""
    found: list[Any] = []
    stack = [value]
    while stack:
        node = stack.pop(0)
        if step.name == "":
            found.extend(_children(node))
        elif isinstance(node, dict) and step.name in node:
            found.append(node[step.name])
        stack.extend(c for c in _children(node) if isinstance(c, dict | list))
    return found


def _matches(step: Step, item: Any) -> bool:
    found = find(item, step.sub)
    if not step.op:
        return bool(found)
    if not found:
        return False
    left, right = found[0], step.literal
    if step.op in ("==", "!="):
        return _equal(left, right) == (step.op == "==")
    try:
        return bool(ORDERINGS[step.op](left, right))
    except TypeError:  # a string against a number: no match, as in client-go
        return False


def _equal(left: Any, right: Any) -> bool:
    """Equal values of one JSON type (``1 == 1.0``, but ``true`` is not ``1``, ``"1"`` not 1)."""
    if isinstance(left, bool) or isinstance(right, bool):
        return left is right
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    return type(left) is type(right) and left == right

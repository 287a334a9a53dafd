"""The ``labelSelector`` query parameter, parsed as the real API server parses it.

Why: a selector the real server refuses must be refused here too, with its 400 text (a
client that builds selectors from run names or user input meets the refusal locally, not
on the first real cluster). This is the lexer and recursive-descent parser of
``k8s.io/apimachinery/pkg/labels`` (v0.32): the same tokens, the same ``found '…',
expected: …`` messages, the same key and value rules
(:mod:`rolloutrun_operator.kube_names`) and the same field paths (``<nil>`` for a key,
``values[i][key]`` for a value).

Pure: :func:`parse` returns ``(key, operator, values)`` triples or raises
:class:`SelectorError` with the message the server puts in its ``BadRequest``.
"""

from __future__ import annotations

from rolloutrun_operator import kube_names

from .validation import go_quote

_SPECIAL = "=!(),><"
_WHITESPACE = " \t\r\n"
_TOKENS = {
    ")": "close",
    ",": "comma",
    "!": "not",
    "==": "==",
    "=": "=",
    ">": "gt",
    "in": "in",
    "<": "lt",
    "!=": "!=",
    "notin": "notin",
    "(": "open",
}
_BINARY = ("in", "notin", "=", "==", "!=", "gt", "lt")
_BINARY_TEXT = "in, notin, =, ==, !=, gt, lt"

Requirement = tuple[str, str, tuple[str, ...]]
"""``(key, operator, values)``; operators ``in notin = == != gt lt exists !``."""


class SelectorError(ValueError):
    """A selector the server refuses; ``str()`` is the server's message."""


def _lex(selector: str) -> list[tuple[str, str]]:
    """``(token, literal)`` pairs, ending with ``("end", "")``."""
    items, pos, size = [], 0, len(selector)
    while True:
        while pos < size and selector[pos] in _WHITESPACE:
            pos += 1
        if pos >= size:
            items.append(("end", ""))
            return items
        start = pos
        if selector[pos] in _SPECIAL:
            token, literal = "", ""
            while pos < size and selector[pos] in _SPECIAL:
                candidate = selector[start : pos + 1]
                if candidate in _TOKENS:
                    token, literal = _TOKENS[candidate], candidate
                elif token:
                    break
                pos += 1
            if not token:
                literal = f"error expected: keyword found '{selector[start:pos]}'"
                token = "error"
            pos = start + len(literal) if token != "error" else pos
            items.append((token, literal))
            continue
        while pos < size and selector[pos] not in _SPECIAL + _WHITESPACE:
            pos += 1
        literal = selector[start:pos]
        items.append((_TOKENS.get(literal, "id"), literal))


class _Parser:
    def __init__(self, selector: str) -> None:
        self.items = _lex(selector)
        self.position = 0

    def lookahead(self, values: bool = True) -> tuple[str, str]:
        return self._as(self.items[self.position], values)

    def consume(self, values: bool = True) -> tuple[str, str]:
        self.position += 1
        return self._as(self.items[self.position - 1], values)

    @staticmethod
    def _as(item: tuple[str, str], values: bool) -> tuple[str, str]:
        token, literal = item
        if values and token in ("in", "notin"):
            return "id", literal
        return token, literal

    def parse(self) -> list[Requirement]:
        requirements: list[Requirement] = []
        while True:
            token, literal = self.lookahead()
            if token == "end":
                return requirements
            if token not in ("id", "not"):
                raise SelectorError(
                    f"found '{literal}', expected: !, identifier, or 'end of string'"
                )
            try:
                requirements.append(self.requirement())
            except SelectorError as error:
                raise SelectorError(f"unable to parse requirement: {error}") from None
            token, literal = self.consume()
            if token == "end":
                return requirements
            if token != "comma":
                raise SelectorError(f"found '{literal}', expected: ',' or 'end of string'")
            token, literal = self.lookahead()
            if token not in ("id", "not"):
                raise SelectorError(f"found '{literal}', expected: identifier after ','")

    def requirement(self) -> Requirement:
        negated = False
        token, key = self.consume()
        if token == "not":
            negated = True
            token, key = self.consume()
        if token != "id":
            raise SelectorError(f"found '{key}', expected: identifier")
        if problems := kube_names.is_qualified_name(key):
            raise SelectorError(f"<nil>: Invalid value: {go_quote(key)}: {'; '.join(problems)}")
        if negated or self.lookahead()[0] in ("end", "comma"):
            return _checked(key, "!" if negated else "exists", ())
        token, operator = self.consume(values=False)
        if token not in _BINARY:
            raise SelectorError(f"found '{operator}', expected: {_BINARY_TEXT}")
        values = self.set_values() if token in ("in", "notin") else self.exact_value()
        return _checked(key, token, tuple(sorted(values)))

    def set_values(self) -> set[str]:
        token, literal = self.consume()
        if token != "open":
            raise SelectorError(f"found '{literal}' expected: '('")
        token, literal = self.lookahead()
        if token == "close":
            self.consume()
            return {""}
        if token not in ("id", "comma"):
            raise SelectorError(f"found '{literal}', expected: ',', ')' or identifier")
        values = self.identifiers()
        if self.consume()[0] != "close":
            raise SelectorError(f"found '{literal}', expected: ')'")
        return values

    def identifiers(self) -> set[str]:
        values: set[str] = set()
        while True:
            token, literal = self.consume()
            if token == "id":
                values.add(literal)
                after, text = self.lookahead()
                if after == "close":
                    return values
                if after != "comma":
                    raise SelectorError(f"found '{text}', expected: ',' or ')'")
            elif token == "comma":
                if not values:
                    values.add("")
                after, _ = self.lookahead()
                if after == "close":
                    values.add("")
                    return values
                if after == "comma":
                    self.consume()
                    values.add("")
            else:
                raise SelectorError(f"found '{literal}', expected: ',', or identifier")

    def exact_value(self) -> set[str]:
        token, _ = self.lookahead()
        if token in ("end", "comma"):
            return {""}
        token, literal = self.consume()
        if token == "id":
            return {literal}
        raise SelectorError(f"found '{literal}', expected: identifier")


def _checked(key: str, operator: str, values: tuple[str, ...]) -> Requirement:
    """``NewRequirement``'s checks on the values (the key was checked while parsing)."""
    errors: list[str] = []
    if operator in ("gt", "lt"):
        for index, value in enumerate(values):
            if not _is_int64(value):
                errors.append(
                    f"values[{index}]: Invalid value: {go_quote(value)}: for 'Gt', 'Lt' "
                    "operators, the value must be an integer"
                )
    for index, value in enumerate(values):
        if problems := kube_names.is_label_value(value):
            errors.append(
                f"values[{index}][{key}]: Invalid value: {go_quote(value)}: {'; '.join(problems)}"
            )
    unique = list(dict.fromkeys(errors))
    if len(unique) == 1:
        raise SelectorError(unique[0])
    if unique:
        raise SelectorError("[" + ", ".join(unique) + "]")
    return key, operator, values


def _is_int64(text: str) -> bool:
    body = text[1:] if text[:1] in "+-" else text
    return body.isascii() and body.isdigit() and -(2**63) <= int(text) < 2**63


def parse(selector: str) -> list[Requirement]:
    """Every requirement of ``selector``, sorted by key as the server sorts them."""
    return sorted(_Parser(selector).parse(), key=lambda requirement: requirement[0])

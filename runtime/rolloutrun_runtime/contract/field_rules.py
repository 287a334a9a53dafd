"""Cross-field rules of the RolloutRun API, each stated once for the API server and pydantic.

A JSON schema cannot say "dModel divisible by nHeads"; a CRD can, in CEL
(``x-kubernetes-validations``), which the API server evaluates at admission. The same rule
must also hold where no API server is involved (``rolloutrun validate``, ``rolloutrun train``,
the operator's own parse), where a pydantic validator checks it. A :class:`FieldRule` keeps
the CEL text and the message together so both enforcers say the same thing.

This module imports only the standard library (it sits in the runtime's contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldRule:
    """A rule across fields of one object, stated once for both of its enforcers.

    Why both: the generated CRD carries ``rule`` (CEL) in the object's
    ``x-kubernetes-validations``, so the API server refuses a violating object at admission
    with ``message``; the pydantic validator raises the same ``message`` (plus the values), so
    ``rolloutrun validate``, ``rolloutrun train`` and the operator's own parse say the same.
    ``rule`` reads the object after the API server's defaulting (every field with a default is
    present in an object that is), so only objects without a default need ``has()``.
    """

    rule: str
    message: str
    #: The field to blame, relative to the object (CEL ``fieldPath``); None: the object.
    field_path: str | None = None
    #: The API server's cause reason (``FieldValueInvalid`` when None).
    reason: str | None = None

    def validation(self) -> dict[str, str]:
        """The ``x-kubernetes-validations`` entry."""
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            entry["fieldPath"] = self.field_path
        if self.reason is not None:
            entry["reason"] = self.reason
        return entry


def cel_rules(*rules: FieldRule) -> dict[str, Any]:
    """The ``json_schema_extra`` that puts ``rules`` into a model's (or field's) schema."""
    return {"x-kubernetes-validations": [rule.validation() for rule in rules]}

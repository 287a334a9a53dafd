"""Kubernetes API errors in the ``Status`` shape the real API server sends.

Clients branch on ``code`` and ``reason`` (the ``kubernetes`` client raises ``ApiException``
with the status code, Kopf maps 404/409/410/422 to its own errors, kubectl prints
``message``), so every error carries the same code, reason and message wording the real
server would use for the same mistake.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client as a ``metav1.Status`` object."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def qualified(plural: str, group: str) -> str:
    """``pods`` for the core group, ``rolloutruns.rolloutrun.dev`` for others."""
    return f"{plural}.{group}" if group else plural


def not_found(plural: str, group: str, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{qualified(plural, group)} "{name}" not found',
        {"name": name, "group": group, "kind": plural},
    )


def already_exists(plural: str, group: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{qualified(plural, group)} "{name}" already exists',
        {"name": name, "group": group, "kind": plural},
    )


def conflict(plural: str, group: str, name: str, why: str | None = None) -> ApiError:
    why = (
        why
        or "the object has been modified; please apply your changes to the latest version "
        "and try again"
    )
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(plural, group)} "{name}": {why}',
        {"name": name, "group": group, "kind": plural},
    )


def invalid(kind: str, group: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """A 422: ``causes`` are ``(reason, field, message)`` triples, reasons like
    ``FieldValueInvalid``, ``FieldValueRequired``, ``FieldValueNotSupported``."""
    messages = list(dict.fromkeys(message for _, _, message in causes))  # as Go's aggregate
    joined = ", ".join(messages)
    if len(messages) > 1:
        joined = "[" + joined + "]"
    return ApiError(
        422,
        "Invalid",
        f'{qualified(kind, group)} "{name}" is invalid: {joined}',
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [
                {"reason": reason, "message": message.removeprefix(f"{field}: "), "field": field}
                for reason, field, message in causes
            ],
        },
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def unprocessable(message: str) -> ApiError:
    """A 422 without causes, as the server answers a JSON patch that cannot apply."""
    return ApiError(422, "Invalid", message)


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def method_not_allowed() -> ApiError:
    return ApiError(
        405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
    )


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, "
        f"application/strategic-merge-patch+json; got {content_type}",
    )


def path_not_found(path: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        "the server could not find the requested resource",
        {
            "causes": [
                {"reason": "UnexpectedServerResponse", "message": f"404 page not found: {path}"}
            ]
        },
    )

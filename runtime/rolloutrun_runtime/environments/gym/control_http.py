"""The HTTP edge of the Gym checkpoint control plane: bearer token, JSON bodies, errors.

Why apart from the state machine in :mod:`rolloutrun_runtime.environments.gym.control`:
every route checks the same token (with the data plane's one check,
:func:`rolloutrun_runtime.policy.http.bearer_ok`), parses the same kind of body, admits the
calling trainer and maps the same failures to statuses; none of that is about checkpoints.
The bodies and answers are the wire contract's models (:mod:`rolloutrun_runtime.contract.wire`),
so this module only turns a request into a dict and an answer (or a :class:`ControlError`)
into a response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.wire import (
    ControlCaller,
    ControlState,
    ErrorBody,
    ErrorDetail,
    TrainerIdentity,
)
from rolloutrun_runtime.policy.http import bearer_ok

#: One route's handler: the request body (``{}`` for a GET) in, its answer out.
Handler = Callable[[dict[str, Any]], Awaitable[ControlState]]


class ControlError(Exception):
    """A control call that cannot be honoured; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def fail(status: int, message: str) -> web.Response:
    """The control plane's error answer: ``{"error": {"message", "code"}}``."""
    body = ErrorBody(error=ErrorDetail(message=message, code=status))
    return web.json_response(body.model_dump(mode="json", exclude_unset=True), status=status)


def _problems(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or '(body)'}: {e['msg']}" for e in error.errors()
    )


async def _read_body(request: web.Request) -> dict[str, Any] | web.Response:
    """A POST's JSON object (``{}`` for a GET), or the 400 that says why it is not one."""
    if request.method != "POST":
        return {}
    try:
        raw = await request.json()
    except ValueError as error:
        return fail(400, f"request body is not valid JSON: {error}")
    if not isinstance(raw, dict):
        return fail(400, "request body must be a JSON object")
    return raw


def guard(
    token: Callable[[], str | None],
    admit: Callable[[TrainerIdentity | None], None],
    handler: Handler,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``handler`` behind the bearer ``token()`` and the trainer admission ``admit``."""

    async def route(request: web.Request) -> web.Response:
        expected = token()
        if not expected:
            return fail(403, f"checkpoint control is disabled: set {ENV_GYM_TOKEN}")
        if not bearer_ok(request, expected):
            return fail(401, "missing or wrong bearer token")
        body = await _read_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            # Every route, before its own checks: a newer trainer takes over, an older
            # one is refused.
            admit(ControlCaller.model_validate(body).trainer)
            answer = await handler(body)
            return web.json_response(answer.model_dump(mode="json"))
        except ValidationError as error:
            return fail(400, f"invalid control request: {_problems(error)}")
        except ControlError as error:
            return fail(error.status, str(error))

    return route

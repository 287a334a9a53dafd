"""Torch-free pieces of the data plane's HTTP interface: wire types, errors, bearer, serving.

Why separate: the Gym servers call the generation service and share its serving helper,
but a Gym pod never runs the model, so importing these must not import torch (which costs
seconds of start-up for every replica).

Why the bearer check lives here: every server between the pods (a Gym's ``/run`` and
``/episodes``, its checkpoint control plane, the generation service) admits a caller by
the run's one token (``contract.pod.ENV_GYM_TOKEN``, from the run's Secret), so they share
one constant-time check and one 401. A server given no token refuses to start: a data
plane open to the whole cluster is never a default.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.wire import (
    UNAUTHORIZED,
    CompletionResult,
    ErrorBody,
    ErrorDetail,
)

#: An aiohttp route handler.
RouteHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MissingTokenError(ValueError):
    """A data-plane server or client was started without the run's bearer token."""


@dataclass(frozen=True)
class GenerationRequest:
    """One model call: continue ``prompt_token_ids`` by up to ``max_tokens`` tokens.

    ``temperature`` 0 means greedy. With a ``seed`` the sampled tokens depend only on the
    seed and the logits. ``weight_version`` pins the weights; ``None`` follows refits.
    ``rollout_id``/``call_index`` key the call's token capture.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    weight_version: int | None = None
    rollout_id: str | None = None
    call_index: int | None = None


@dataclass(frozen=True)
class GenerationResult:
    """Generated tokens, their behaviour logprobs and the weight version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str  # "stop" (eos) or "length"

    def to_json(self) -> dict[str, object]:
        """The ``POST /v1/completions`` answer (a :class:`CompletionResult`)."""
        answer = CompletionResult(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            weight_versions=self.weight_versions,
            finish_reason=self.finish_reason,
        )
        return answer.model_dump(mode="json")


def json_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "code"}}``."""
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, code=status))
    return web.json_response(body.model_dump(mode="json"), status=status)


async def serve_app(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    cancel_on_disconnect: bool = False,
) -> tuple[web.AppRunner, str]:
    """Start ``app`` on ``host:port`` (0 picks a free port); return its runner and base URL.

    ``cancel_on_disconnect`` cancels a request's handler when its client goes away (the Gym
    uses it so a vanished trainer's episodes stop at once instead of running on unobserved).
    """
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel_on_disconnect)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    if not sockets:
        await runner.cleanup()
        raise OSError(f"server on {host}:{port} has no listening socket")
    bound_port = sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    return runner, f"http://{url_host}:{bound_port}"


def data_plane_token(token: str | None, what: str) -> str:
    """``token``, else the run's token from :data:`ENV_GYM_TOKEN`; refuse when neither is set.

    ``what`` names the server or client in the error (``"the Gym server"``).
    """
    resolved = token if token is not None else os.environ.get(ENV_GYM_TOKEN, "")
    if not resolved:
        raise MissingTokenError(
            f"{what} needs the run's data-plane token: set {ENV_GYM_TOKEN} (the run's "
            "Secret gives it to the trainer and every Gym) or pass token="
        )
    return resolved


def bearer_headers(token: str) -> dict[str, str]:
    """The header a client sends to every data-plane route."""
    return {"Authorization": f"Bearer {token}"}


def bearer_ok(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries ``Bearer <token>`` (constant-time comparison)."""
    supplied = request.headers.get("Authorization", "")
    return hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode())


def unauthorized() -> web.Response:
    """The 401 of a call without the right bearer token (the wire's :class:`ErrorBody`)."""
    return json_error(401, "missing or wrong bearer token", UNAUTHORIZED)


def authenticated(token: str, handler: RouteHandler) -> RouteHandler:
    """``handler`` behind the bearer ``token``: a caller without it gets :func:`unauthorized`."""

    async def route(request: web.Request) -> web.StreamResponse:
        if not bearer_ok(request, token):
            return unauthorized()
        return await handler(request)

    return route


def bounded(text: object, limit: int = 200) -> str:
    """``text`` as one printable line of at most ``limit`` characters (for echoing a peer)."""
    line = "".join(c if c.isprintable() else " " for c in str(text))
    return line if len(line) <= limit else line[: limit - 1] + "…"


def is_unreachable(error: BaseException) -> bool:
    """Whether a transport error means the endpoint was not there (not the episode's fault):
    the trainer's Gym client and the Gym's policy client decide alike.

    A plain timeout is the episode running past ``rolloutTimeoutSeconds`` (a failed sample);
    a timeout while *connecting* is not.
    """
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return True
    if isinstance(error, TimeoutError):
        return False
    return isinstance(
        error,
        aiohttp.ClientConnectorError
        | aiohttp.ServerDisconnectedError
        | aiohttp.ClientOSError
        | ConnectionError,
    )

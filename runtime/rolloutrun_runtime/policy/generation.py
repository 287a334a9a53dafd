"""The generation service: the engine behind an OpenAI-completions-like HTTP subset.

Why HTTP: the Gym servers (other processes, other pods) call the policy once per turn, as
NeMo Gym calls vLLM's OpenAI server. Requests and responses carry token ids, not text, so
the training sequence is exactly what the policy saw and produced (no re-tokenization
drift), plus the behaviour logprob and the weight version of every token.

Routes:

- ``POST /v1/completions``: one model call (see ``contract.wire.CompletionRequest``), answered with
  ``token_ids``, ``logprobs``, ``weight_versions`` and ``finish_reason``;
- ``GET /v1/weight_version``: the newest installed version (and the versions kept);
- ``GET /token-capture/rollouts/{rollout_id}`` / ``DELETE`` the same: a rollout's captured
  calls, and their release;
- ``GET /healthz``.

Every route but ``/healthz`` needs the run's bearer token (401 without it); the app
refuses to be built without one (see :func:`rolloutrun_runtime.policy.http.data_plane_token`).

Every body is a model of :mod:`rolloutrun_runtime.contract.wire`, which the Gym's policy
client builds its requests from. Bad input gets a 4xx whose ``error.message`` names the
problem; a pinned version the engine does not hold gets 409.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from rolloutrun_runtime.contract.wire import (
    COMPLETIONS_ROUTE,
    HEALTHZ_ROUTE,
    TOKEN_CAPTURE_ROUTE,
    WEIGHT_VERSION_ROUTE,
    CompletionRequest,
    GenerationHealth,
    TokenCaptureAnswer,
    TokenCaptureReleased,
    WeightVersionAnswer,
)
from rolloutrun_runtime.policy.engine import (
    EngineClosedError,
    GenerationEngine,
    GenerationError,
    InvalidRequestError,
    RefitError,
    UnknownVersionError,
)
from rolloutrun_runtime.policy.http import (
    GenerationRequest,
    GenerationResult,
    authenticated,
    data_plane_token,
    json_error,
    serve_app,
)
from rolloutrun_runtime.policy.token_capture import TokenCapture

__all__ = [
    "ENGINE_KEY",
    "GenerationEngine",
    "GenerationError",
    "GenerationRequest",
    "GenerationResult",
    "InvalidRequestError",
    "RefitError",
    "TokenCapture",
    "UnknownVersionError",
    "build_generation_app",
    "json_error",
    "serve_app",
]

logger = logging.getLogger(__name__)

#: Largest completion request body accepted (a prompt of max_seq_len ids is far smaller).
MAX_REQUEST_BYTES = 4 * 1024 * 1024

ENGINE_KEY = web.AppKey("engine", GenerationEngine)


def to_request(body: CompletionRequest) -> GenerationRequest:
    """The engine's request for a validated completion body."""
    return GenerationRequest(
        prompt_token_ids=tuple(body.prompt_token_ids),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        seed=body.seed,
        weight_version=body.weight_version,
        rollout_id=body.rollout_id,
        call_index=body.call_index,
    )


def validation_message(error: ValidationError, what: str) -> str:
    """One line per problem, naming the field: ``max_tokens: Input should be ...``."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(body)"
        problems.append(f"{where}: {item['msg']}")
    return f"invalid {what}: " + "; ".join(problems)


async def read_json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The body as a JSON object, or the 4xx response that says why it is not one."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return json_error(
            413, f"request body is larger than the {request.app._client_max_size}-byte limit"
        )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return json_error(400, f"request body is not valid JSON: {error}")
    if not isinstance(body, dict):
        return json_error(400, f"request body must be a JSON object, not {type(body).__name__}")
    return body


async def _completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await read_json_object(request)
    if isinstance(body, web.Response):
        return body
    try:
        parsed = CompletionRequest.model_validate(body)
    except ValidationError as error:
        return json_error(400, validation_message(error, "completion request"))
    try:
        result = await engine.generate(to_request(parsed))
    except InvalidRequestError as error:
        return json_error(400, str(error))
    except UnknownVersionError as error:
        return json_error(409, str(error), "unknown_weight_version")
    except EngineClosedError as error:
        return json_error(503, str(error), "unavailable")
    except GenerationError as error:
        return json_error(500, str(error), "generation_error")
    return web.json_response(result.to_json())


async def _weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    answer = WeightVersionAnswer(version=engine.version, versions=engine.versions)
    return web.json_response(answer.model_dump(mode="json"))


async def _capture_get(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    calls = request.app[ENGINE_KEY].capture.get(rollout_id)
    if calls is None:
        return json_error(404, f"no token capture for rollout {rollout_id!r}", "not_found")
    return web.json_response(
        TokenCaptureAnswer(rollout_id=rollout_id, calls=calls).model_dump(mode="json")
    )


async def _capture_delete(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    released = request.app[ENGINE_KEY].capture.release(rollout_id)
    answer = TokenCaptureReleased(rollout_id=rollout_id, released=released)
    return web.json_response(answer.model_dump(mode="json"))


async def _healthz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(
        GenerationHealth(status="ok", version=engine.version).model_dump(mode="json")
    )


def build_generation_app(
    engine: GenerationEngine, stop_engine: bool = True, *, token: str | None = None
) -> web.Application:
    """The aiohttp app serving ``engine``; with ``stop_engine`` its cleanup stops the engine.

    ``token`` (default: the run's, from ``ENV_GYM_TOKEN``) guards every route but
    ``/healthz``; with neither, :class:`~rolloutrun_runtime.policy.http.MissingTokenError`.
    """
    bearer = data_plane_token(token, "the generation server")
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[ENGINE_KEY] = engine
    app.router.add_post(COMPLETIONS_ROUTE, authenticated(bearer, _completions))
    app.router.add_get(WEIGHT_VERSION_ROUTE, authenticated(bearer, _weight_version))
    app.router.add_get(TOKEN_CAPTURE_ROUTE, authenticated(bearer, _capture_get))
    app.router.add_delete(TOKEN_CAPTURE_ROUTE, authenticated(bearer, _capture_delete))
    app.router.add_get(HEALTHZ_ROUTE, _healthz)
    if stop_engine:

        async def _stop(_: web.Application) -> None:
            await engine.stop()

        app.on_cleanup.append(_stop)
    return app

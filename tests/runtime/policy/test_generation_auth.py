"""The generation service admits only the run's token (issue 12: unauthenticated data plane).

A real generation server on loopback: completions, the weight version and the token capture
(read and release) answer 401 without the run's bearer token and leave the engine untouched;
``/healthz`` stays open for probes; a server without a token refuses to be built.
"""

from __future__ import annotations

import aiohttp
import pytest

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.wire import ErrorBody
from rolloutrun_runtime.policy.generation import build_generation_app
from rolloutrun_runtime.policy.http import MissingTokenError, bearer_headers, serve_app
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from tests.support.data_plane import HEADERS
from tests.support.scripted_gym import scripted_engine


@pytest.mark.parametrize("headers", [{}, bearer_headers("not-the-token")])
async def test_every_generation_route_but_health_needs_the_token(
    headers: dict[str, str],
) -> None:
    engine = scripted_engine()
    runner, url = await serve_app(build_generation_app(engine))
    body = {"prompt_token_ids": TOKENIZER.encode("1+"), "max_tokens": 4, "rollout_id": "r0"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=body, headers=HEADERS) as r:
                assert r.status == 200  # the run's own caller is served
            calls = [
                ("POST", "/v1/completions", body),
                ("GET", "/v1/weight_version", None),
                ("GET", "/token-capture/rollouts/r0", None),
                ("DELETE", "/token-capture/rollouts/r0", None),
            ]
            for method, path, payload in calls:
                async with session.request(method, url + path, json=payload, headers=headers) as r:
                    assert r.status == 401, (path, await r.text())
                    error = ErrorBody.model_validate(await r.json()).error
                    assert error.code == 401 and error.type == "unauthorized"
            async with session.get(url + "/healthz") as r:
                assert r.status == 200
        assert engine.capture.get("r0") is not None  # the release was refused
    finally:
        await runner.cleanup()


def test_a_generation_server_without_a_token_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_GYM_TOKEN)
    with pytest.raises(MissingTokenError, match=ENV_GYM_TOKEN):
        build_generation_app(scripted_engine())

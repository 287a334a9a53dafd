"""The Gym's data plane admits only the run's trainer (issue 12: unauthenticated data plane).

Real Gym servers on loopback: ``/run``, ``/episodes`` and ``/policy`` answer 401 without
the run's bearer token; a ``/run`` naming a generation address the trainer did not announce
is refused and that address is never contacted (no SSRF); what a policy answers reaches the
``/run`` caller only as a bounded excerpt; a server without a token refuses to start.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rolloutrun_runtime.algorithms.gym_client import GymClient
from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.wire import ErrorBody
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.agent import LocalPolicyClient
from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.http import MissingTokenError, bearer_headers, serve_app
from tests.support.data_plane import HEADERS, announce
from tests.support.scripted_gym import CFG, NOWHERE, THREE, scripted_engine


def _body(policy_url: str, rollout_id: str = "r0") -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": 0},
        "prompt_id": THREE,
        "policy_url": policy_url,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 7},
    }


class Recorder:
    """A loopback HTTP server that records every request and answers ``status`` with ``body``."""

    def __init__(self, status: int = 200, body: bytes = b"{}") -> None:
        self.status, self.body = status, body
        self.seen: list[str] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(f"{request.method} {request.path}")
        return web.Response(status=self.status, body=self.body, content_type="application/json")


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner, url = await serve_app(app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def _recorder(serve: Any, recorder: Recorder) -> Recorder:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    recorder.url = await serve(app)
    return recorder


@pytest.mark.parametrize("headers", [{}, bearer_headers("not-the-token"), {"Authorization": ""}])
async def test_every_data_route_needs_the_token(serve: Any, headers: dict[str, str]) -> None:
    server = GymServer("gym-0", CFG, policy=LocalPolicyClient(scripted_engine().generate))
    gym = await serve(server.app)
    calls = [
        ("POST", "/run", _body(NOWHERE)),
        ("GET", "/episodes/r0", None),
        ("POST", "/policy", {"policy_urls": [NOWHERE]}),
    ]
    async with aiohttp.ClientSession() as session:
        for method, path, body in calls:
            async with session.request(method, gym + path, json=body, headers=headers) as r:
                assert r.status == 401, (path, await r.text())
                error = ErrorBody.model_validate(await r.json()).error
                assert error.code == 401 and "bearer token" in error.message
        async with session.get(gym + "/healthz") as r:  # probes stay open
            assert r.status == 200
    assert server.episodes == {} and server.announced_policies == {}


async def test_a_hostile_policy_url_is_refused_and_never_contacted(serve: Any) -> None:
    hostile = await _recorder(serve, Recorder())
    policy = await _recorder(serve, Recorder())
    gym = await serve(GymServer("gym-0", CFG).app)
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        await announce(session, gym, policy.url)
        for target in (hostile.url, hostile.url + "/internal", "http://169.254.169.254"):
            async with session.post(gym + "/run", json=_body(target)) as r:
                assert r.status == 403
                error = ErrorBody.model_validate(await r.json()).error
                assert error.type == "policy_not_announced"
                assert "not a generation address the trainer announced" in error.message
    assert hostile.seen == []


async def test_a_policy_error_reaches_the_caller_only_as_a_bounded_excerpt(serve: Any) -> None:
    secret = "internal-secret-" + "x" * 5000 + "\nSet-Cookie: a=b"
    body = ErrorBody.model_validate({"error": {"message": secret, "code": 500}})
    policy = await _recorder(serve, Recorder(500, body.model_dump_json().encode()))
    gym = await serve(GymServer("gym-0", CFG).app)
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        await announce(session, gym, policy.url)
        async with session.post(gym + "/run", json=_body(policy.url)) as r:
            assert r.status == 502
            message = ErrorBody.model_validate(await r.json()).error.message
    assert policy.seen == ["POST /v1/completions"]
    assert "internal-secret-" in message and len(message) < 600 and "\n" not in message
    assert "Set-Cookie" not in message


async def test_the_policy_client_sends_the_token(serve: Any) -> None:
    policy = await _recorder(serve, Recorder(401, b'{"error": {"message": "no", "code": 401}}'))
    seen: list[str] = []

    @web.middleware
    async def authorization(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        return await handler(request)

    app = web.Application(middlewares=[authorization])
    app.router.add_route("*", "/{tail:.*}", policy.handle)
    policy.url = await serve(app)
    gym = await serve(GymServer("gym-0", CFG).app)
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        await announce(session, gym, policy.url)
        async with session.post(gym + "/run", json=_body(policy.url)) as r:
            assert r.status == 502
    assert seen == [HEADERS["Authorization"]]


async def test_the_trainer_client_announces_again_after_a_gym_forgets(serve: Any) -> None:
    server = GymServer("gym-0", CFG, policy=LocalPolicyClient(scripted_engine().generate))
    gym = await serve(server.app)
    client = GymClient(
        [gym], timeout_s=30, max_seq_len=CFG.policy.max_seq_len, overhead=OverheadClock()
    )
    await client.open()
    try:
        sampling = {"temperature": 1.0, "max_new_tokens": 8, "seed": 7}
        replica = client.pick(None)
        first = await client.run_episode(replica, EnvironmentEpisode("a"), THREE, NOWHERE, sampling)
        assert list(server.announced_policies) == [NOWHERE]
        server.announced_policies.clear()  # as a restarted replica
        again = await client.run_episode(replica, EnvironmentEpisode("b"), THREE, NOWHERE, sampling)
    finally:
        await client.close()
    assert first["reward"] == again["reward"] and list(server.announced_policies) == [NOWHERE]


def test_a_gym_without_a_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_GYM_TOKEN)
    with pytest.raises(MissingTokenError, match=ENV_GYM_TOKEN):
        GymServer("gym-0", CFG)
    with pytest.raises(MissingTokenError, match=ENV_GYM_TOKEN):
        GymClient([NOWHERE], timeout_s=1, max_seq_len=8, overhead=OverheadClock())

"""Which failed Gym calls are infrastructure (back off, stay pending) and which are samples.

An endpoint that cannot be reached (refused, reset, closed mid-call, DNS, connect timeout, a
502/503/504 the Gym did not write) is infrastructure; an answer about the episode (the Gym's
own JSON error, a malformed result, an episode past ``rolloutTimeoutSeconds``) is a failed
sample. The backoff never draws from the global ``random`` (training state), and the
outage budget names the endpoint and the time spent once it runs out.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rolloutrun_runtime.algorithms.gym_client import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    GymCallError,
    GymClient,
    GymOutageError,
    GymUnavailableError,
    GymUnreachableError,
    OutageBudget,
    backoff_delay,
    is_unreachable,
    is_unreachable_status,
)
from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.http import json_error, serve_app

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.mark.parametrize(
    "error",
    [
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientOSError(104, "Connection reset by peer"),
        aiohttp.ConnectionTimeoutError("Connection timeout to host"),
        ConnectionRefusedError(111, "refused"),
        ConnectionResetError(104, "reset"),
    ],
)
def test_errors_that_never_reached_a_gym_are_infrastructure(error):
    assert is_unreachable(error)


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError(),  # the total timeout: the episode ran past rolloutTimeoutSeconds
        aiohttp.SocketTimeoutError("Timeout on reading data from socket"),
        aiohttp.ClientPayloadError("Response payload is not completed"),
        ValueError("bad"),
    ],
)
def test_errors_about_the_episode_are_samples(error):
    assert not is_unreachable(error)


def test_only_a_gateway_status_the_gym_did_not_write_is_infrastructure():
    gym_body = json.dumps({"error": {"message": "policy", "type": "policy_error", "code": 502}})
    assert is_unreachable_status(503, b"<html>Service Unavailable</html>")
    assert is_unreachable_status(502, b"")
    assert is_unreachable_status(504, b'{"error": "upstream timed out"}')
    assert not is_unreachable_status(502, gym_body.encode())  # the Gym: the policy failed
    assert not is_unreachable_status(500, b"Internal Server Error")
    assert not is_unreachable_status(409, b"")
    assert not is_unreachable_status(200, b"")


def test_backoff_grows_to_its_cap_with_jitter_in_the_upper_half():
    ceilings = [backoff_delay(tries, 0.999999) for tries in range(1, 12)]
    assert ceilings == sorted(ceilings)
    assert ceilings[0] == pytest.approx(BACKOFF_FIRST_S, rel=1e-5)
    assert ceilings[-1] == pytest.approx(BACKOFF_MAX_S, rel=1e-5)
    assert backoff_delay(1, 0.0) == BACKOFF_FIRST_S / 2
    assert backoff_delay(10_000, 0.0) == BACKOFF_MAX_S / 2
    with pytest.raises(ValueError, match="tries"):
        backoff_delay(0, 0.5)
    with pytest.raises(ValueError, match="unit"):
        backoff_delay(1, 1.0)


def test_the_backoff_leaves_the_training_random_state_alone():
    client = GymClient(["http://127.0.0.1:1"], timeout_s=1, max_seq_len=8, overhead=OverheadClock())
    random.seed(1234)
    before = random.getstate()
    delays = [client.backoff(tries) for tries in range(1, 6)]
    assert random.getstate() == before
    assert all(0 < d <= BACKOFF_MAX_S for d in delays)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_outage_budget_is_per_endpoint_and_ends_with_an_answer():
    clock = _Clock()
    budget = OutageBudget(30, clock=clock)
    cause = ConnectionRefusedError(111, "refused")
    assert budget.unreachable("http://a", cause) == 0.0
    clock.now += 20
    assert budget.unreachable("http://a", cause) == 20.0
    assert budget.unreachable("http://b", cause) == 0.0  # its own outage starts now
    budget.answered("http://a")  # it answered (even an error about an episode)
    clock.now += 20
    assert budget.unreachable("http://a", cause) == 0.0
    assert budget.unreachable("http://b", cause) == 20.0
    clock.now += 10
    with pytest.raises(GymOutageError) as spent:
        budget.unreachable("http://b", cause)
    message = str(spent.value)
    assert "http://b" in message and "unreachable for 30.0s" in message
    assert "gymUnreachableSeconds 30" in message and "refused" in message
    assert isinstance(spent.value, GymUnavailableError)
    with pytest.raises(ValueError, match="positive"):
        OutageBudget(0)


# ------------------------------------------------------------------ real sockets
async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"instance_id": "gym-test"})


async def _announced(request: web.Request) -> web.Response:
    """``POST /policy``: the trainer announces its generation address before a ``/run``."""
    return web.json_response(await request.json())


@pytest.fixture
async def gym_with() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[GymClient, Any]]]]:
    """Serve ``/run`` with a handler; returns an open client and the server's runner."""
    opened: list[tuple[GymClient, Any]] = []

    async def start(handler: Handler) -> tuple[GymClient, Any]:
        app = web.Application()
        app.router.add_get("/healthz", _healthz)
        app.router.add_post("/run", handler)
        app.router.add_post("/policy", _announced)
        runner, url = await serve_app(app)
        client = GymClient([url], timeout_s=1, max_seq_len=32, overhead=OverheadClock())
        await client.open()
        opened.append((client, runner))
        return client, runner

    yield start
    for client, runner in opened:
        await client.close()
        await runner.cleanup()


async def _run(client: GymClient) -> dict[str, Any]:
    return await client.run_episode(
        client.replicas[0], EnvironmentEpisode("r0", 0), 1, "http://127.0.0.1:9/v1", {}
    )


async def test_a_stopped_replica_is_unreachable(gym_with):
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    client, runner = await gym_with(ok)
    await runner.cleanup()
    with pytest.raises(GymUnreachableError) as unreachable:
        await _run(client)
    assert unreachable.value.endpoint == client.replicas[0].url
    assert client.replicas[0].url in str(unreachable.value)


async def test_a_replica_closing_the_connection_mid_call_is_unreachable(gym_with):
    async def hang_up(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(0.5)
        return web.json_response({})

    client, _ = await gym_with(hang_up)
    with pytest.raises(GymUnreachableError):
        await _run(client)


async def test_a_bare_503_is_unreachable_but_the_gyms_own_502_is_a_sample(gym_with):
    async def going_away(request: web.Request) -> web.Response:
        return web.Response(status=503, text="Service Unavailable")

    client, _ = await gym_with(going_away)
    with pytest.raises(GymUnreachableError, match="503"):
        await _run(client)

    async def policy_failed(request: web.Request) -> web.Response:
        return json_error(502, "episode r0 failed: policy unreachable", "policy_error")

    client, _ = await gym_with(policy_failed)
    with pytest.raises(GymCallError, match="502") as failed:
        await _run(client)
    assert not isinstance(failed.value, GymUnavailableError)


async def test_an_episode_past_the_timeout_is_a_sample(gym_with):
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.json_response({})

    client, _ = await gym_with(slow)
    with pytest.raises(GymCallError):
        await _run(client)
    assert client.outages.outages() == {}  # an answer (or a slow episode) is no outage

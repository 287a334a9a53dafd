"""The trainer's ``/metrics`` admits only the run's metrics token (issue 16: least privilege).

A real metrics server on loopback: no token, a wrong token and the run's data-plane token
are answered 401; the metrics token gets the exposition (parsed). The other way round, a
real Gym server and a real generation server answer the metrics token 401: a scraper holding
it cannot drive the data plane. A metrics server given no token refuses to start.
"""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutrun_runtime.contract.pod import ENV_METRICS_PORT, ENV_METRICS_TOKEN
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.pod import take_metrics_token
from rolloutrun_runtime.policy.generation import build_generation_app
from rolloutrun_runtime.policy.http import bearer_headers, serve_app
from rolloutrun_runtime.prometheus import (
    MetricsServer,
    MissingMetricsTokenError,
    TrainerMetrics,
    metrics_token,
)
from tests.support.data_plane import HEADERS, TOKEN
from tests.support.scripted_gym import CFG, scripted_engine

METRICS_TOKEN = "test-metrics-token"


@pytest.mark.parametrize(
    "headers",
    [{}, bearer_headers("not-the-token"), HEADERS, {"Authorization": METRICS_TOKEN}],
    ids=["none", "wrong", "data-plane-token", "no-bearer-scheme"],
)
async def test_metrics_without_the_metrics_token_is_401(headers: dict[str, str]) -> None:
    server = await MetricsServer(TrainerMetrics(run="r", step=3), METRICS_TOKEN).start(
        "127.0.0.1", 0
    )
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}/metrics"
            async with session.get(url, headers=headers) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
                assert "rolloutrun_trainer_step" not in await response.text()
    finally:
        await server.stop()


async def test_the_metrics_token_gets_the_parsed_metrics() -> None:
    server = await MetricsServer(TrainerMetrics(run="r", step=3), METRICS_TOKEN).start(
        "127.0.0.1", 0
    )
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        async with (
            aiohttp.ClientSession(headers=bearer_headers(METRICS_TOKEN)) as session,
            session.get(url) as response,
        ):
            assert response.status == 200
            text = await response.text()
    finally:
        await server.stop()
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples["rolloutrun_trainer_step"].value == 3
    assert samples["rolloutrun_trainer_step"].labels == {"run": "r"}


async def test_the_metrics_token_opens_neither_the_gym_nor_the_generation_api() -> None:
    gym_runner, gym = await serve_app(GymServer("gym-0", CFG).app)
    gen_runner, gen = await serve_app(build_generation_app(scripted_engine()))
    try:
        async with aiohttp.ClientSession(headers=bearer_headers(METRICS_TOKEN)) as session:
            calls = [
                (gym + "/run", {"episode_id": {"rollout_id": "r0", "attempt": 0}}),
                (gym + "/policy", {"policy_urls": [gen]}),
                (gen + "/v1/completions", {"prompt_token_ids": [1], "max_tokens": 1}),
            ]
            for url, body in calls:
                async with session.post(url, json=body) as response:
                    assert response.status == 401, url
            async with session.get(gen + "/v1/weight_version") as response:
                assert response.status == 401
    finally:
        await gym_runner.cleanup()
        await gen_runner.cleanup()
    assert METRICS_TOKEN != TOKEN


def test_a_metrics_server_without_a_token_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_METRICS_TOKEN, raising=False)
    with pytest.raises(MissingMetricsTokenError, match=ENV_METRICS_TOKEN) as error:
        metrics_token(None)
    assert ENV_METRICS_PORT in str(error.value)  # the other way out: no metrics server
    with pytest.raises(MissingMetricsTokenError):
        MetricsServer(TrainerMetrics(run="r"), "")
    assert metrics_token(None, {ENV_METRICS_TOKEN: "t"}) == "t"


def test_the_trainer_takes_the_metrics_token_out_of_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_METRICS_TOKEN, METRICS_TOKEN)
    assert take_metrics_token() == METRICS_TOKEN
    assert take_metrics_token() is None  # no child process inherits it

"""Worker backends: start, serve over HTTP, refit to a new version, stop."""

from __future__ import annotations

import aiohttp
import pytest

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.policy.model import build_model
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.workers import PolicyWorkers, WorkerError, build_workers
from rolloutrun_runtime.workers.inprocess import InProcessWorkers
from tests.support.data_plane import HEADERS


def _cfg(backend: str, workers: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "policy": {"device": "cpu"},
            "workers": {"backend": backend, "generationWorkers": workers},
        }
    )


async def _exercise(workers: PolicyWorkers, count: int, host: str = "127.0.0.1") -> None:
    """Start, serve version 3, refit to 4 on every endpoint, stop."""
    cfg_policy = _cfg("inprocess", 1).policy
    await workers.start()
    try:
        assert len(workers.endpoints) == count
        assert all(url.startswith(f"http://{host}:") for url in workers.endpoints)
        body = {"prompt_token_ids": [TOKENIZER.bos_id, 4], "max_tokens": 4, "seed": 1}
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            for url in workers.endpoints:
                async with http.post(url + "/v1/completions", json=body) as response:
                    assert set((await response.json())["weight_versions"]) == {3}
            await workers.refit(build_model(cfg_policy, TOKENIZER.vocab_size, 9).state_dict(), 4)
            for url in workers.endpoints:
                async with http.get(url + "/v1/weight_version") as response:
                    assert (await response.json())["version"] == 4
                async with http.post(url + "/v1/completions", json=body) as response:
                    assert set((await response.json())["weight_versions"]) == {4}
    finally:
        await workers.stop()
    assert workers.endpoints == []
    await workers.stop()  # idempotent


async def test_inprocess_workers_refit_and_endpoints() -> None:
    cfg = _cfg("inprocess", 2)
    workers = build_workers(cfg, build_model(cfg.policy, TOKENIZER.vocab_size, 0).state_dict(), 3)
    assert isinstance(workers, InProcessWorkers) and isinstance(workers, PolicyWorkers)
    with pytest.raises(WorkerError, match="before the workers were started"):
        await workers.refit({}, 1)
    await _exercise(workers, 2)
    with pytest.raises(WorkerError, match="already started"):
        await workers.start()


@pytest.mark.ray
async def test_ray_workers_refit_and_endpoints(ray_session: None) -> None:
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    cfg = _cfg("ray", 1)
    # In a pod the actors listen on $POD_IP (here another loopback address), not 127.0.0.1.
    state = build_model(cfg.policy, TOKENIZER.vocab_size, 0).state_dict()
    workers = build_workers(cfg, state, 3, host="127.0.0.7")
    assert isinstance(workers, RayWorkers) and isinstance(workers, PolicyWorkers)
    await _exercise(workers, 1, host="127.0.0.7")


def test_ray_actors_ask_for_gpus_only_when_they_compute_on_them() -> None:
    from rolloutrun_runtime.contract.run_config import Device
    from rolloutrun_runtime.workers.ray_placement import actor_gpus

    assert actor_gpus(Device.CPU, 8, 2) == 0.0
    assert actor_gpus(Device.AUTO, 0, 2) == 0.0
    assert actor_gpus(Device.AUTO, 4, 2) == 1.0
    assert actor_gpus(Device.CUDA, 1, 4) == 0.25
    with pytest.raises(WorkerError, match="no GPUs"):
        actor_gpus(Device.CUDA, 0, 1)

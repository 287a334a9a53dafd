"""Warm standby generation actors: started and serving but handed to no Gym; when an active
actor's process is SIGKILLed (its worker node lost), a standby takes its index at once,
without a refit, serving the latest refit's weights, and a new standby refills the pool.
Before: a new actor was created for the index and served only once its server had started
(a new worker pod's Ray node joining, its imports: ~10 s on the pod path)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import aiohttp
import pytest
import ray

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.policy.model import build_model
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from tests.support.data_plane import HEADERS

#: Only a hang guard (Ray reports a death in seconds; actors start in seconds).
LIMIT_S = 120

CFG = RunConfig.model_validate(
    {
        "policy": {"device": "cpu"},
        "workers": {"backend": "ray", "generationWorkers": 2, "standbyWorkers": 1},
    }
)


def _weights(seed: int):
    return build_model(CFG.policy, TOKENIZER.vocab_size, seed).state_dict()


def _pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60))


async def _version(url: str) -> int:
    async with (
        aiohttp.ClientSession(headers=HEADERS) as http,
        http.get(url + "/v1/weight_version") as response,
    ):
        return int((await response.json())["version"])


@pytest.mark.ray
async def test_a_standby_takes_a_sigkilled_workers_place_at_once(ray_session: None) -> None:
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    workers = RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    try:
        async with asyncio.timeout(LIMIT_S):
            while not workers.standbys:
                await asyncio.sleep(0.05)
        standby, placement = workers.standbys[0]
        warm = placement["url"]
        assert warm not in workers.endpoints  # serving, but handed to no Gym
        assert await _version(warm) == 1
        await workers.refit(_weights(1), 2)  # the standby is not refit: it waits
        survivor, lost = workers.endpoints
        pid = await asyncio.to_thread(_pid, workers._actors[1])
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(LIMIT_S):  # no refit comes: only Ray's report of the death
            while warm not in workers.endpoints:
                await asyncio.sleep(0.02)
        assert workers.endpoints == [survivor, warm] and lost not in workers.endpoints
        assert workers._actors[1] is standby
        assert await _version(warm) == 2  # the latest refit's weights before it served
        assert workers.replacements == {1: 1} and workers.promotions == 1
        assert workers.pending == {}  # no new actor for the index: the standby took it
        assert len(workers.standbys) + len(workers.standby_starting) == 1  # refilled
        async with asyncio.timeout(LIMIT_S):
            while not workers.standbys:
                await asyncio.sleep(0.05)
        assert workers.standbys[0][1]["url"] not in workers.endpoints
        await workers.refit(_weights(2), 3)
        assert [await _version(url) for url in workers.endpoints] == [3, 3]
    finally:
        await workers.stop()
    assert workers.standbys == [] and workers.standby_starting == {}


@pytest.mark.chaos  # one more actor start: ~30 s on a shared machine
@pytest.mark.ray
async def test_a_lost_standby_is_replaced_in_the_pool_and_serves_nobody(ray_session: None):
    """A standby's node lost while it waits: another standby starts; no active index counts
    a replacement and no endpoint changes."""
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    workers = RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    try:
        async with asyncio.timeout(LIMIT_S):
            while not workers.standbys:
                await asyncio.sleep(0.05)
        before = list(workers.endpoints)
        standby, _ = workers.standbys[0]
        os.kill(await asyncio.to_thread(_pid, standby), signal.SIGKILL)
        async with asyncio.timeout(LIMIT_S):
            while workers.standby_losses == 0:
                await asyncio.sleep(0.02)
        assert workers.endpoints == before and workers.replacements == {}
        assert workers.promotions == 0
        async with asyncio.timeout(LIMIT_S):
            while not workers.standbys:
                await asyncio.sleep(0.05)
        assert workers.standbys[0][0] is not standby
    finally:
        await workers.stop()

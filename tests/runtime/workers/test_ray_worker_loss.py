"""A lost generation actor (its worker node gone) does not stop the run: its endpoint leaves
at once, a replacement starts under its index and is re-admitted at the next refit serving
the weights of that refit; replacements are bounded and end in a named error."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import ray

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.policy.model import build_model
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.workers import WorkerError
from tests.support.data_plane import HEADERS

#: Bound of a wait for Ray's report of a death: a report that never comes fails the test.
READMIT_LIMIT_S = 60

CFG = RunConfig.model_validate(
    {"policy": {"device": "cpu"}, "workers": {"backend": "ray", "generationWorkers": 2}}
)


def _weights(seed: int):
    return build_model(CFG.policy, TOKENIZER.vocab_size, seed).state_dict()


async def _lose(workers, index: int) -> None:
    """The actor's process dies as on a lost node (no cleanup, no graceful stop)."""
    ray.kill(workers._actors[index], no_restart=True)
    await asyncio.sleep(0)


@pytest.mark.ray
async def test_a_lost_actor_is_replaced_and_readmitted_at_the_next_refit(ray_session: None):
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    workers = RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    try:
        survivor, _ = workers.endpoints
        await _lose(workers, 1)
        await workers.refit(_weights(1), 2)  # before: WorkerError, the run stopped
        assert workers.endpoints == [survivor]  # no episode goes to the lost one
        assert set(workers.pending) == {1} and workers.replacements == {1: 1}
        _, starting = workers.pending[1]
        await asyncio.wait_for(starting, 120)
        await workers.refit(_weights(2), 3)
        assert workers.pending == {} and len(workers.endpoints) == 2
        assert workers.placements[1] is not None and workers.endpoints[0] == survivor
        readmitted = workers.endpoints[1]
        async with (
            aiohttp.ClientSession(headers=HEADERS) as http,
            http.get(readmitted + "/v1/weight_version") as response,
        ):
            assert (await response.json())["version"] == 3
    finally:
        await workers.stop()


@pytest.mark.ray
async def test_replacements_are_bounded(ray_session: None, monkeypatch: pytest.MonkeyPatch):
    from rolloutrun_runtime.workers import ray_workers

    monkeypatch.setattr(ray_workers, "MAX_ACTOR_REPLACEMENTS", 1)
    workers = ray_workers.RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    try:
        await _lose(workers, 0)
        await workers.refit(_weights(1), 2)
        _, starting = workers.pending[0]
        await asyncio.wait_for(starting, 120)
        await workers.refit(_weights(2), 3)
        await _lose(workers, 0)
        with pytest.raises(WorkerError, match=r"generation worker 0 was lost 2 times \(limit 1\)"):
            await workers.refit(_weights(3), 4)
    finally:
        await workers.stop()


@pytest.mark.ray
async def test_a_dead_actor_leaves_the_handed_out_endpoints_at_once(ray_session: None):
    """Ray's report of the death (no refit in between) takes the endpoint out of what the
    pump hands the Gyms, and starts the replacement; the next refit admits it once (before:
    the dead endpoint was handed out until the next refit found the actor dead)."""
    from rolloutrun_runtime.workers.endpoints import PolicyEndpoints
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    workers = RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    policies = PolicyEndpoints(workers, budget_s=60)
    try:
        survivor, dead = workers.endpoints
        assert {await policies.pick() for _ in range(4)} == {survivor, dead}
        await _lose(workers, 1)
        async with asyncio.timeout(READMIT_LIMIT_S):  # only catches a hang: no refit comes
            while dead in workers.endpoints:
                await asyncio.sleep(0.05)
        assert {await policies.pick() for _ in range(8)} == {survivor}
        assert set(workers.pending) == {1} and workers.replacements == {1: 1}
        _, starting = workers.pending[1]
        await asyncio.wait_for(starting, 120)
        await workers.refit(_weights(1), 2)  # the dead actor is not replaced a second time
        assert workers.pending == {} and workers.replacements == {1: 1}
        assert len(workers.endpoints) == 2 and workers.endpoints[0] == survivor
        assert {await policies.pick() for _ in range(4)} == set(workers.endpoints)
    finally:
        await policies.close()
        await workers.stop()


@pytest.mark.ray
async def test_when_every_actor_dies_between_refits_a_replacement_serves_without_one(
    ray_session: None,
):
    """No actor serves, so no step (and no refit) can come: the first replacement whose
    server starts is admitted at once, on the last refit's weights (before: the pump waited
    for an endpoint until rollout.gymUnreachableSeconds and the trainer stopped); the other
    joins at the next refit, as while some actor serves."""
    from rolloutrun_runtime.workers.endpoints import PolicyEndpoints
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    workers = RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    policies = PolicyEndpoints(workers, budget_s=READMIT_LIMIT_S * 4)
    try:
        await workers.refit(_weights(1), 2)
        await _lose(workers, 0)
        await _lose(workers, 1)
        async with asyncio.timeout(READMIT_LIMIT_S * 4):  # only catches a hang
            while workers.replacements != {0: 1, 1: 1}:  # both deaths reported by Ray
                await asyncio.sleep(0.05)
            picked = await policies.pick()  # waits while none serves: no refit comes
        assert picked in workers.endpoints
        async with (
            aiohttp.ClientSession(headers=HEADERS) as http,
            http.get(picked + "/v1/weight_version") as response,
        ):
            assert (await response.json())["version"] == 2  # the last refit's weights
        for _, starting in list(workers.pending.values()):
            await asyncio.wait_for(starting, 120)
        await workers.refit(_weights(2), 3)
        assert workers.pending == {} and len(workers.endpoints) == 2
        assert workers.replacements == {0: 1, 1: 1}
    finally:
        await policies.close()
        await workers.stop()


@pytest.mark.ray
async def test_a_refit_waits_on_when_a_replacement_is_lost_before_it_serves(ray_session: None):
    """Every actor lost, and their replacements lost before they started (their node lost
    too): the refit replaces them again and waits for those (bounded), where it stopped
    the run at the first failed start (seen in the worker-pod e2e on a loaded machine)."""
    from rolloutrun_runtime.workers.ray_workers import RayWorkers

    workers = RayWorkers(CFG, _weights(0), 1)
    await workers.start()
    try:
        await _lose(workers, 0)
        await _lose(workers, 1)
        async with asyncio.timeout(READMIT_LIMIT_S):  # only catches a hang
            while workers.replacements != {0: 1, 1: 1}:  # both deaths reported by Ray
                await asyncio.sleep(0.05)
        for replacement, _ in list(workers.pending.values()):
            ray.kill(replacement, no_restart=True)
        await workers.refit(_weights(1), 2)
        assert workers.endpoints and workers.replacements == {0: 2, 1: 2}
    finally:
        await workers.stop()

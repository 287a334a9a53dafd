"""The trainer keys turn-level checkpoints by the ids the Gym replicas report, not by order;
a replica silent at start is keyed by its pod id where one is derivable, else waited for
within the unreachable budget (then a named ``GymOutageError``)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from rolloutrun_runtime.algorithms.gym_outages import GymOutageError
from rolloutrun_runtime.contract.pod import gym_instance_id
from rolloutrun_runtime.contract.run_config import parse_run_config
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.policy.http import serve_app
from rolloutrun_runtime.trainer_inputs import gym_instance_ids as _gym_instance_ids

CFG = parse_run_config({"task": {"name": "reach_target"}, "checkpointing": {"targetLevel": "turn"}})


async def _serve(instance_id: str) -> tuple[web.AppRunner, str]:
    runner, url = await serve_app(GymServer(instance_id, CFG).app)
    return runner, url


async def test_pod_named_replicas_map_to_their_own_urls() -> None:
    started = [await _serve(name) for name in ("demo-gym-1", "demo-gym-0")]
    try:
        urls = [url for _, url in started]
        assert await _gym_instance_ids(urls) == {"demo-gym-1": urls[0], "demo-gym-0": urls[1]}
    finally:
        for runner, _ in started:
            await runner.cleanup()


async def test_two_replicas_claiming_one_id_are_refused() -> None:
    started = [await _serve("demo-gym-0") for _ in range(2)]
    try:
        with pytest.raises(RuntimeError, match="both call themselves 'demo-gym-0'"):
            await _gym_instance_ids([url for _, url in started])
    finally:
        for runner, _ in started:
            await runner.cleanup()


async def test_an_unreachable_replica_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"http://127\.0\.0\.1:9 did not answer /healthz"):
        await _gym_instance_ids(["http://127.0.0.1:9"])


def _free_url() -> str:
    """A loopback address nothing listens on now (a replica lost, or not started yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _pod_id(index: int) -> str:
    return gym_instance_id("demo", index)


async def test_in_a_pod_a_silent_replica_is_keyed_by_its_derived_id() -> None:
    """Before: "did not answer /healthz", and the turn-level trainer ended at start."""
    runner, url = await _serve("demo-gym-0")
    silent = _free_url()
    try:
        found = await _gym_instance_ids([url, silent], pod_ids=_pod_id, budget_s=60)
        assert found == {"demo-gym-0": url, "demo-gym-1": silent}
    finally:
        await runner.cleanup()


async def test_a_pod_whose_replicas_name_other_ids_derives_nothing() -> None:
    """The rule is checked, not assumed: a replica answering with an id other than its
    derived one leaves the silent one to be waited for (here past the budget)."""
    runner, url = await _serve("elsewhere-0")
    silent = _free_url()
    try:
        with pytest.raises(GymOutageError, match=r"gymUnreachableSeconds 0\.3") as outage:
            await _gym_instance_ids([url, silent], pod_ids=_pod_id, budget_s=0.3)
        assert silent in str(outage.value)
    finally:
        await runner.cleanup()


async def test_a_static_silent_replica_is_waited_for_and_taken_when_it_answers() -> None:
    runner, url = await _serve("gym-0")
    silent = _free_url()
    port = int(silent.rsplit(":", 1)[1])
    late: list[web.AppRunner] = []

    async def comes_up() -> None:
        await asyncio.sleep(0.3)
        runner, _ = await serve_app(GymServer("gym-1", CFG).app, port=port)
        late.append(runner)

    up = asyncio.ensure_future(comes_up())
    try:
        found = await asyncio.wait_for(_gym_instance_ids([url, silent], budget_s=60), 60)
        assert found == {"gym-0": url, "gym-1": silent}
    finally:
        await up
        await runner.cleanup()
        for started in late:
            await started.cleanup()


async def test_a_static_silent_replica_past_the_budget_is_a_named_outage() -> None:
    runner, url = await _serve("gym-0")
    silent = _free_url()
    try:
        with pytest.raises(GymOutageError, match=r"gymUnreachableSeconds 0\.3") as outage:
            await _gym_instance_ids([url, silent], budget_s=0.3)
        assert f"{silent} did not answer /healthz" in str(outage.value)
    finally:
        await runner.cleanup()

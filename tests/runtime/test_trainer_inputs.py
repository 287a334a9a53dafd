"""What the trainer settles first: turn level needs every environment's control plane.

The built-in Gym with its control plane names ``checkpoint_control`` in ``/healthz``; a
server without it (the built-in Gym served bare here, the user's own in
tests/runtime/test_user_environment.py) makes a turn-level run recover at sibling level,
with the reason naming the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from rolloutrun_runtime.contract.run_config import TargetLevel, parse_run_config
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.control import GymCheckpointControl
from rolloutrun_runtime.policy.http import serve_app
from rolloutrun_runtime.trainer_inputs import (
    lacking_control_plane,
    recovery_level,
    with_recovery_level,
)

CFG = parse_run_config({"task": {"name": "reach_target"}, "checkpointing": {"targetLevel": "turn"}})


def test_only_turn_level_is_lowered_and_only_when_a_server_lacks_the_plane() -> None:
    assert recovery_level(TargetLevel.TURN, []) == (TargetLevel.TURN, None)
    assert recovery_level(TargetLevel.SIBLING, ["http://a"]) == (TargetLevel.SIBLING, None)
    level, note = recovery_level(TargetLevel.TURN, ["http://a:1", "http://b:2"])
    assert level is TargetLevel.SIBLING
    assert note is not None and "http://a:1, http://b:2" in note and "sibling level" in note


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []

    async def start(instance_id: str, control: bool) -> str:
        server = GymServer(instance_id, CFG)
        if control:  # as gym_main serves it
            server.continue_restored = GymCheckpointControl(server).claim_restored
        runner, url = await serve_app(server.app)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_built_in_gym_with_its_control_plane_keeps_turn_level(serve: Any) -> None:
    urls = [await serve("gym-0", True), await serve("gym-1", True)]
    assert await lacking_control_plane(urls) == []
    cfg = CFG.model_copy(update={"gym": CFG.gym.model_copy(update={"endpoints": urls})})
    settled, note = await with_recovery_level(cfg)
    assert settled.checkpointing.target_level is TargetLevel.TURN and note is None


async def test_a_server_without_the_plane_lowers_the_run_to_sibling(serve: Any) -> None:
    urls = [await serve("gym-0", True), await serve("gym-1", False)]
    cfg = CFG.model_copy(update={"gym": CFG.gym.model_copy(update={"endpoints": urls})})
    settled, note = await with_recovery_level(cfg)
    assert settled.checkpointing.target_level is TargetLevel.SIBLING
    assert note is not None and urls[1] in note and urls[0] not in note
    assert cfg.checkpointing.target_level is TargetLevel.TURN  # the caller's config is kept


async def test_an_unanswering_server_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"http://127\.0\.0\.1:9 did not answer /healthz"):
        await lacking_control_plane(["http://127.0.0.1:9"])


async def test_a_silent_server_among_answering_ones_is_judged_when_it_answers(
    serve: Any,
) -> None:
    """Issue 14: a Gym down while the trainer starts is not the end of the trainer; only
    those that answer decide the level (before: "did not answer /healthz" ended it)."""
    urls = [await serve("gym-0", True), "http://127.0.0.1:9"]
    assert await lacking_control_plane(urls) == []
    urls = [await serve("gym-0", False), "http://127.0.0.1:9"]
    assert await lacking_control_plane(urls) == [urls[0]]

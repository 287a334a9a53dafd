"""Issue 12, "Sizes": a restore larger than the Gym's request limit, over real HTTP.

A real Gym server with its control plane listens on loopback with the default
``gym.requestMaxBytes`` (1 MiB); the trainer-side client restores snapshots of several MiB of
episode records. Before the fix the whole body got a 413 and every episode restarted from
turn 0; now the records travel in chunks under the limit, installed under one restore id
(all or nothing), and only a record that alone exceeds the limit is refused, by name.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rolloutrun_runtime.contract.run_config import parse_run_config
from rolloutrun_runtime.environments.checkpointing import (
    EnvironmentCheckpointError,
    build_environment_checkpoint,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import restore_scope
from rolloutrun_runtime.environments.checkpointing.nemo_gym import (
    GymEnvironmentCheckpoint,
    GymSnapshot,
)
from rolloutrun_runtime.environments.checkpointing.restore_chunks import (
    BODY_MARGIN_BYTES,
    json_size,
    plan_chunks,
)
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.control import ControlPhase, GymCheckpointControl
from rolloutrun_runtime.environments.gym.episode import (
    Episode,
    EpisodeId,
    Phase,
    Sampling,
    Segment,
)
from rolloutrun_runtime.policy.generation import serve_app

TOKEN = "s3cret"
MIB = 1024 * 1024
CFG = parse_run_config(
    {
        "policy": {"device": "cpu"},
        "task": {"name": "reach_target", "maxOperand": 9, "maxTurns": 12},
        "checkpointing": {"targetLevel": "turn"},
    }
)


def record(rollout_id: str, turn: int, tokens: int) -> dict[str, Any]:
    """A live episode's snapshot record at ``turn`` with ``tokens`` model tokens."""
    episode = Episode(
        episode_id=EpisodeId(rollout_id, 0),
        prompt_id=1,
        policy_url="http://127.0.0.1:9",
        sampling=Sampling(temperature=1.0, max_new_tokens=8),
        state={"value": turn},
        segments=[
            Segment("prompt", [1, 2, 3]),
            Segment("model", [12345] * tokens, [-0.125] * tokens, [0] * tokens),
        ],
        phase=Phase.AWAIT_MODEL,
        turn=turn,
    )
    return episode.to_record()


def many_records(total_bytes: int, each_tokens: int = 20_000) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    while sum(json_size(r) for r in records) < total_bytes:
        index = len(records)
        records.append(record(f"r{index}", turn=1 + index % 7, tokens=each_tokens))
    return records


class Gym:
    """One Gym replica with its control plane on loopback (default request limit)."""

    def __init__(self) -> None:
        self.server: GymServer
        self.control: GymCheckpointControl
        self.url = ""
        self.runner: Any = None

    async def start(self, tmp: Path) -> None:
        self.server = GymServer("gym-0", CFG, tmp / "gym-0.audit.jsonl")
        self.control = GymCheckpointControl(self.server, TOKEN, grace_s=5.0)
        self.server.continue_restored = self.control.claim_restored
        self.runner, self.url = await serve_app(self.server.app, cancel_on_disconnect=True)

    def restored_turns(self) -> dict[str, int]:
        return {
            key.rollout_id: self.server.episodes[key].turn
            for key in self.control.restored_unclaimed
        }


@pytest.fixture
async def gym(tmp_path: Path) -> AsyncIterator[Gym]:
    gym = Gym()
    await gym.start(tmp_path)
    yield gym
    await gym.runner.cleanup()


@pytest.fixture
async def client(gym: Gym) -> AsyncIterator[GymEnvironmentCheckpoint]:
    async with aiohttp.ClientSession() as session:
        yield GymEnvironmentCheckpoint({"gym-0": gym.url}, TOKEN, session=session)


def deadline() -> float:
    return time.time() + 30.0


def snapshot_of(records: list[dict[str, Any]]) -> bytes:
    return GymSnapshot("ck", {"gym-0": records}).to_bytes()


async def test_a_4_mib_restore_restores_every_episode_at_its_turn(
    gym: Gym, client: GymEnvironmentCheckpoint
) -> None:
    assert gym.server.cfg.gym.request_max_bytes == MIB  # the default limit
    records = many_records(4 * MIB)
    assert json_size(records) > 4 * MIB  # the body one restore call used to be
    async with restore_scope(client, "ck-big", deadline(), snapshot_of(records)) as outcome:
        assert gym.control.phase is ControlPhase.RESTORED
        assert not outcome.refused
        assert [e.rollout_id for e in outcome.restored] == sorted(
            r["episode_id"]["rollout_id"] for r in records
        )
        assert gym.restored_turns() == {r["episode_id"]["rollout_id"]: r["turn"] for r in records}
    assert gym.control.phase is ControlPhase.IDLE  # kept: every chunk stays installed
    assert len(gym.control.restored_unclaimed) == len(records)


async def test_a_failed_later_chunk_drops_the_earlier_chunks(
    gym: Gym, client: GymEnvironmentCheckpoint
) -> None:
    records = many_records(3 * MIB)
    broken = dict(records[-1], version=-1)  # the Gym refuses it with a 400
    before = dict(gym.server.episodes)
    with pytest.raises(EnvironmentCheckpointError) as failed:
        await client.restore("ck-half", deadline(), snapshot_of([*records[:-1], broken]))
    found = re.search(
        r"chunk (\d+): episode record version -1 .*\(restore chunk \1 of", str(failed.value)
    )
    assert found is not None and int(found.group(1)) > 0, failed.value
    # The Gym had installed the earlier chunks; the failed chunk dropped them all.
    assert "ck-half" in gym.control.dropped
    assert gym.control.phase is ControlPhase.IDLE
    assert not gym.control.restored_unclaimed and not gym.control.retired
    assert gym.server.episodes == before
    # Nothing half installed: the same snapshot restores whole afterwards.
    outcome = await client.restore("ck-again", deadline(), snapshot_of(records))
    assert len(outcome.restored) == len(records) and not outcome.refused


async def test_a_later_chunk_of_a_dropped_restore_is_refused(
    gym: Gym, client: GymEnvironmentCheckpoint
) -> None:
    """A chunk that arrives after its restore was dropped (lease, newer trainer) must not
    install its records alone."""
    records = many_records(2 * MIB)
    await client.restore("ck-lone", deadline(), snapshot_of(records))
    await client.end_restore("ck-lone", keep=False)
    body = {
        "checkpoint_id": "ck-other",
        "deadline_ts": deadline(),
        "records": records[:1],
        "chunk": 1,
    }
    with pytest.raises(EnvironmentCheckpointError, match="chunk 1 arrived but the restore"):
        await client._post("gym-0", "restore", body)
    assert not gym.control.restored_unclaimed


async def test_a_record_bigger_than_the_limit_is_refused_by_name(
    gym: Gym, client: GymEnvironmentCheckpoint
) -> None:
    small = [record(f"s{i}", turn=2, tokens=100) for i in range(3)]
    huge = record("huge", turn=5, tokens=200_000)
    size = json_size(huge)
    assert size > MIB
    outcome = await client.restore("ck-huge", deadline(), snapshot_of([*small, huge]))
    assert sorted(e.rollout_id for e in outcome.restored) == ["s0", "s1", "s2"]
    [(episode, why)] = outcome.refused
    assert (episode.rollout_id, episode.attempt, episode.instance_id) == ("huge", 0, "gym-0")
    assert f"{size} bytes" in why and f"gym.requestMaxBytes = {MIB} bytes" in why
    assert gym.restored_turns() == {"s0": 2, "s1": 2, "s2": 2}


async def test_the_builder_takes_the_limit_from_the_run_config() -> None:
    cfg = CFG.model_copy(update={"gym": CFG.gym.model_copy(update={"request_max_bytes": 65_536})})
    client = build_environment_checkpoint(cfg, {"gym-0": "http://127.0.0.1:9"}, TOKEN)
    assert isinstance(client, GymEnvironmentCheckpoint)
    assert client.request_max_bytes == 65_536
    await client.close()


def test_plan_chunks_keeps_order_and_every_body_under_the_limit() -> None:
    records = [record(f"r{i}", turn=1, tokens=200 * (1 + i % 5)) for i in range(40)]
    limit, envelope = 20_000, 300
    plan = plan_chunks(records, limit, envelope)
    assert [r for chunk in plan.chunks for r in chunk] == records and not plan.oversized
    assert len(plan.chunks) > 1
    for chunk in plan.chunks:
        assert envelope + json_size(chunk) <= limit - BODY_MARGIN_BYTES
    assert plan_chunks([], limit, envelope).chunks == [[]]  # chunk 0 opens the scope
    with pytest.raises(ValueError, match="leaves no room"):
        plan_chunks(records, 1024, 1000)

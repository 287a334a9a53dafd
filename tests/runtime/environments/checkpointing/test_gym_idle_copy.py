"""The idle copy at prepare looks only at the episodes that can rest live with no ``/run``.

Why: prepare copies at once the live episodes no ``/run`` drives. It found them by scanning
every episode the replica keeps (up to ``MAX_FINISHED_EPISODES``, 50,000 finished ones), at
every snapshot, so a snapshot's Gym cost grew with the run. The episodes that can rest live
are the restored unclaimed ones and those a ``/run`` drove to a boundary (or claimed from a
restore) until it ends them; the control plane now keeps that set, and forgets an episode
once it ends.
"""

from __future__ import annotations

import asyncio

from rolloutrun_runtime.environments.checkpointing.nemo_gym import GymSnapshot
from rolloutrun_runtime.environments.gym.control import ControlPhase
from rolloutrun_runtime.environments.gym.episode import Episode, EpisodeId, Phase
from tests.support.gym_checkpoint_rig import LONG, Rig, deadline
from tests.support.scripted_gym import bare_episode


async def test_a_restored_unclaimed_episode_is_copied_without_a_scan_of_everybare_episode(
    rig: Rig,
) -> None:
    """A restored episode no ``/run`` has claimed rests live at its boundary: the next
    prepare copies it, without going over the thousands of finished episodes kept."""
    await rig.start_gym()
    server, control, _ = rig.gyms["gym-0"]
    for n in range(3000):
        server.install(bare_episode(f"done-{n}", Phase.FINISHED))
    record = bare_episode("resting", Phase.AWAIT_MODEL).to_record()
    client = rig.client()
    await client.restore("ck0", deadline(), GymSnapshot("ck0", {"gym-0": [record]}).to_bytes())
    await client.end_restore("ck0", keep=True)
    assert control.restored_unclaimed == {EpisodeId("resting", 1)}

    def scan() -> list[Episode]:
        raise AssertionError("prepare scanned every episode the replica keeps")

    server.live_episodes = scan  # type: ignore[method-assign]
    await client.prepare("ck1", deadline())
    assert control.phase is ControlPhase.PREPARED
    assert set(control.copies) == {EpisodeId("resting", 1)}
    await client.resume("ck1")


async def test_episodes_that_ended_are_forgotten(rig: Rig) -> None:
    """What the control plane keeps of the episodes that may rest stays as small as what is
    live: an episode whose ``/run`` ended it is dropped from it at once."""
    await rig.start_gym()
    _, control, _ = rig.gyms["gym-0"]
    runs = [rig.run("gym-0", f"r{i}", prompt_id=LONG[i]) for i in range(3)]
    for status, _ in await asyncio.gather(*runs):
        assert status == 200
    assert control.resting.live() == []
    assert len(control.resting) == 0

"""A relaunch from turn 0 never reuses an episode id the lost incarnation may have run
(issue 10, finding 1).

Deterministic mode holds the siblings of groups admitted for a later step until the weights
of the step before are served, so a snapshot cut then records them *reserved*; the
incarnation goes on and dispatches them after the cut. Its replacement restores the snapshot
and must relaunch those siblings under new rollout ids: before, it sent the same rollout id
at Gym attempt 0 again, to whichever replica it picked, and a replica that had not applied
them repeated their side effects.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import dispatched_episodes
from rolloutrun_runtime.data_plane import MutationCut
from rolloutrun_runtime.environments.checkpointing import EnvironmentEpisode
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.episode import EpisodeId
from rolloutrun_runtime.experience.rollout_recovery import (
    PromptRef,
    RecoveryLedger,
    RestoreLevel,
)
from tests.support.rollout_checkpoints import (
    crash_after_snapshot,
    harness,
    run_to_end,
    tiny_config,
)


async def test_a_restart_relaunches_every_unrestored_episode_under_a_new_id(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[int, EpisodeId]] = []  # (incarnation, episode) of every fresh /run
    incarnation = 0
    original = GymServer._conflict

    def recording(self: GymServer, episode_id: EpisodeId) -> Any:
        started.append((incarnation, episode_id))
        return original(self, episode_id)

    monkeypatch.setattr(GymServer, "_conflict", recording)
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(tmp_path, grpo={"maxSteps": 4}, checkpointing={"deterministic": True})
        )
        first = await h.controller(cfg)
        await crash_after_snapshot(first, snapshot_at=1, stop_at=2)
        incarnation = 1
        second = await h.controller(cfg)
        restored = await second.restore()
        assert restored is not None and restored.ledger is not None
        reserved_at_cut = {
            group.siblings[0].current.rollout_id
            for group in restored.ledger.groups()
            if group.siblings[0].current.status.value == "reserved"
        }
        await run_to_end(second)
    assert reserved_at_cut, "no attempt was reserved at the cut: the test proves nothing"
    first_ids = {e for n, e in started if n == 0}
    second_ids = [e for n, e in started if n == 1]
    ran_after_cut = reserved_at_cut & {e.rollout_id for e in first_ids}
    assert ran_after_cut, "the first incarnation ran none of them after the cut"
    assert not first_ids & set(second_ids), "an episode was relaunched under the same id"
    assert max(Counter(second_ids).values()) == 1


def test_a_snapshot_exports_restored_episodes_awaiting_their_dispatch() -> None:
    """A restored episode not yet dispatched again is out on its instance: the snapshot
    keeps its record, so the next restart continues it instead of relaunching it."""
    ledger = RecoveryLedger()
    cut = MutationCut("test")
    ledger.reserve_group(
        cut,
        group_id="grp",
        admission_id="adm",
        prompt=PromptRef(prompt_id=1, epoch=0, index=0),
        target_step=1,
        start_weight_version=0,
        group_size=2,
        restore_level=RestoreLevel.TURN,
    )
    ledger.admit(cut, "grp")
    resumed = ledger.sibling("grp_g0").current
    ledger.dispatch(cut, "grp_g0", resumed.attempt_uuid, "gym-1")
    ledger.prepare_for_restart(cut, {resumed.rollout_id: "gym-1"})
    assert (resumed.status.value, resumed.gym_attempt) == ("reserved", 1)
    assert dispatched_episodes(ledger) == [EnvironmentEpisode(resumed.rollout_id, 1, "gym-1")]

"""Elastic members at turn level: a Gym lost mid-episode does not cost its episodes' turns.

A turn-level run with one Gym replica; right after a rollout snapshot is published (its
records hold copies of the episodes running at turn boundaries), the replica's server is
stopped and the next member generation starts at a new address. Each lost episode that has
a record goes on from it on the replacement (the redispatched ``/run`` carries the record;
same rollout id, environment attempt + 1) instead of restarting at turn 0 under a new
rollout id, and the run-wide side-effect log shows it: the continuation's first effect is
at the recorded turn, the revisions go on without a gap, none is applied twice, and the
durable-state audit is clean. Before, every lost attempt was abandoned and restarted from
turn 0 (no ``attempt_restored`` and no effect at environment attempt 1).

In deterministic mode the final weights equal an uninterrupted run's (the oracle for Gym
loss at turn level, in process; the operator's is ``tests/oracle``).
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.algorithms.single_controller import NoHooks
from rolloutrun_runtime.audit import audit, load_durable_state
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.trainer import run_trainer
from tests.support.data_plane import TOKEN
from tests.support.elastic_gyms import ElasticGyms
from tests.support.run_configs import tiny_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 240
MAX_STEPS = 4


def _config(log_dir: Path) -> RunConfig:
    return tiny_config(
        log_dir,
        seed=13,
        policy={"maxSeqLen": 48},
        task={
            "name": "reach_target",
            "datasetSize": 64,
            "maxOperand": 9,
            "maxTurns": 6,
            "maxNewTokens": 3,
            "turnDelayMs": 60,
        },
        grpo={"maxSteps": MAX_STEPS, "maxStaleness": 1, "promptsPerStep": 2},
        rollout={"maxAttempts": 3, "gymUnreachableSeconds": 30},
        gym={"replicas": 1},
        checkpointing={
            "targetLevel": "turn",
            "deterministic": True,
            "snapshotIntervalSeconds": 0,
            "snapshotEveryRollouts": 6,
        },
    )


class _LoseGymAfterPublish(NoHooks):
    """Replaces Gym 0 right after the first snapshot published past step 1."""

    def __init__(self, gyms: ElasticGyms) -> None:
        self.gyms = gyms
        self.replaced: list[asyncio.Task[None]] = []

    def on_published(self, published: dict[str, Any]) -> None:
        if not self.replaced and published["train_step"] >= 1:
            self.replaced.append(asyncio.get_running_loop().create_task(self.gyms.replace(0)))


async def _run(cfg: RunConfig, *, lose: bool) -> tuple[Any, ElasticGyms, list[Any]]:
    gyms = ElasticGyms(cfg, TOKEN)
    await gyms.start()
    hooks = _LoseGymAfterPublish(gyms) if lose else NoHooks()
    try:
        run = run_trainer(gyms.config(), hooks=hooks, gym_members=gyms.endpoints)
        result = await asyncio.wait_for(run, RUN_LIMIT_S)
        replaced = getattr(hooks, "replaced", [])
        await asyncio.gather(*replaced)
    finally:
        await gyms.stop()
    return result, gyms, replaced


def _effects(audit_file: Path) -> dict[str, list[dict[str, Any]]]:
    by_rollout: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in audit_file.read_text().splitlines():
        entry = json.loads(line)
        by_rollout[entry["rollout_id"]].append(entry)
    return by_rollout


@pytest.mark.timeout(600)
async def test_a_lost_gyms_episode_goes_on_at_its_recorded_turn_on_the_replacement(tmp_path):
    reference, _, _ = await _run(_config(tmp_path / "reference"), lose=False)
    cfg = _config(tmp_path / "elastic")
    result, gyms, replaced = await _run(cfg, lose=True)
    assert replaced, "no snapshot was published past step 1: the Gym was never lost"

    events = list(read_events(Path(cfg.log_dir) / TRACE_FILE))
    resumed = [e for e in events if e["event"] == "attempt_restored" and e.get("level") == "member"]
    assert resumed, "no lost episode went on from its record"
    assert not [e for e in events if e["event"] == "attempt_failed"]  # never a failed sample

    # The side-effect log of the run (both generations of gym-0 append to it): a continued
    # rollout's effects at environment attempt 1 begin at the turn its record held (> 0:
    # not a restart), revisions 1..n each once.
    continued = {
        rollout_id: entries
        for rollout_id, entries in _effects(gyms.audit_file(0)).items()
        if any(e["attempt"] >= 1 for e in entries)
    }
    assert continued, "no continued episode applied a side effect on the replacement"
    for rollout_id, entries in continued.items():
        revisions = [e["revision"] for e in entries]
        assert revisions == list(range(1, len(revisions) + 1)), (rollout_id, revisions)
        first_resumed = next(e for e in entries if e["attempt"] >= 1)
        assert first_resumed["turn"] > 0, (rollout_id, entries)
    assert gyms.runs.get((0, 1), 0) > 0  # the replacement did the work

    state = load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS)
    report = audit(state)
    assert report.ok, report
    assert (report.prompts.lost, report.prompts.duplicated) == (0, 0)

    for key in ("step", "groups", "prompt_ids", "shortfall", "replacements", "loss"):
        assert [r[key] for r in result.history] == [r[key] for r in reference.history], key
    assert result.final_weights_sha256 == reference.final_weights_sha256

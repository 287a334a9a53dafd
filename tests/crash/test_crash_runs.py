"""SIGKILL a real trainer at named crash sites and at random moments, resume, audit.

Each test runs ``rolloutrun chaos``'s harness on a tiny config: the Gym replicas survive,
the trainer process is killed, restarted on the same log directory, run to ``maxSteps``
and audited from durable state (no prompt lost or trained twice per epoch, no side effect
applied twice, ``gym_attempt`` consistent, no orphaned row). The default run kills at a few
sites plus one random moment and checks bit-identical weights once; ``make chaos`` runs
every site and longer random campaigns (``-m chaos``).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.chaos import REFERENCE_DIR, ChaosResult, run_chaos
from rolloutrun_runtime.contract.layout import (
    DATA_SEGMENTS_PREFIX,
    DEFAULT_STORAGE_DIR,
    MANIFEST_NAME,
    SNAPSHOTS_PREFIX,
)
from rolloutrun_runtime.crash import CRASH_SITES
from rolloutrun_runtime.metrics import read_metrics
from rolloutrun_runtime.storage import open_storage

from .conftest import INCARNATION_TIMEOUT_S, MULTI_TURN, SINGLE_TURN, write_config

#: ``site:hit`` — hits chosen so the kill lands mid-run (8 steps, 4 groups a step, a
#: snapshot about every second); a restore site is reached only by the incarnation after a
#: first kill (right after the first snapshot is published).
DEFAULT_SITES = (
    "after_dataloader_advance:5",
    "inside_optimizer_commit:5",
    "after_manifest_write:2",
)
OTHER_SITES = (
    "inside_finalize_commit:12",
    "after_data_plane_save:2",
    "before_manifest_write:2",
    "during_trainer_checkpoint_finalize:2",
    "during_restore:1",
    "during_segment_gc:1",
    # a call of the snapshot writer's child process in flight (the second snapshot's)
    "trainer_while_helper_writes:5",
)
#: A snapshot's new data-plane segments durable, its manifest not written (default suite).
SEGMENT_SITE = "after_segment_write:2"
GYM_SITES = ("during_gym_prepare:2", "during_gym_commit:2", "during_gym_resume:1")
#: Reached only when a snapshot publishes before step 1 commits (slow first rollouts).
FIRST_CHECKPOINT_SITES = ("before_first_checkpoint:1",)
RESTORE_SITES = ("during_restore", "during_gym_resume")
#: The writer process's own sites: they kill the child, not the trainer, so no campaign arms
#: them; tests/runtime/storage/test_writer_process.py does.
WRITER_CHILD_SITES = ("helper_mid_write", "helper_before_settle")


def test_the_campaigns_cover_every_site() -> None:
    covered = {
        spec.split(":")[0]
        for spec in DEFAULT_SITES
        + OTHER_SITES
        + GYM_SITES
        + FIRST_CHECKPOINT_SITES
        + (SEGMENT_SITE,)
        + WRITER_CHILD_SITES
    }
    assert covered == set(CRASH_SITES)


def _campaign(config: Path, run_dir: Path, **kwargs: object) -> ChaosResult:
    result = run_chaos(
        config,
        run_dir,
        incarnation_timeout_s=INCARNATION_TIMEOUT_S,
        **kwargs,  # type: ignore[arg-type]
    )
    (run_dir / "chaos-result.json").write_text(json.dumps(result.to_json(), indent=1))
    return result


def _kills_for(site: str) -> int:
    return 2 if site.split(":")[0] in RESTORE_SITES else 1


def _assert_site_kill(result: ChaosResult, site: str) -> None:
    name, hit = site.split(":")
    assert (result.kills[-1].how, result.kills[-1].site, result.kills[-1].hit) == (
        "site",
        name,
        int(hit),
    ), result.to_json()


def _assert_whole(result: ChaosResult, kills: int) -> None:
    detail = json.dumps(result.to_json(), indent=1)[:4000]
    assert len(result.kills) == kills, detail
    assert result.exit_codes == [-signal.SIGKILL] * kills + [0], detail
    assert result.audit.get("ok") is True, detail
    assert (result.audit["lost"], result.audit["duplicated"]) == (0, 0), detail


@pytest.mark.parametrize("site", DEFAULT_SITES)
def test_kill_at_a_named_site_resumes_and_audits(
    site: str, single_turn: Path, tmp_path: Path
) -> None:
    result = _campaign(single_turn, tmp_path / "run", kills=1, site=site, compare=False, seed=1)
    _assert_whole(result, 1)
    _assert_site_kill(result, site)
    assert result.kills[0].restored_from is not None


def test_kill_between_segment_write_and_manifest_resumes_and_collects(tmp_path: Path) -> None:
    """SIGKILL after a snapshot's new data-plane segments are durable and before its
    manifest: the next incarnation restores the previous snapshot (whose segments nothing
    deleted), the run audits clean, and at the end every stored segment is one a committed
    manifest lists once the orphan grace has passed (the killed publisher's segment is
    collected then, not before)."""
    # a snapshot after every step: each one has new rows, so the second writes a segment
    config = write_config(
        tmp_path / "every-step.yaml", SINGLE_TURN, checkpointing={"snapshotEverySteps": 1}
    )
    result = _campaign(config, tmp_path / "run", kills=1, site=SEGMENT_SITE, compare=False, seed=1)
    _assert_whole(result, 1)
    _assert_site_kill(result, SEGMENT_SITE)
    assert result.kills[0].restored_from is not None
    root = tmp_path / "run" / DEFAULT_STORAGE_DIR
    listed = {
        key
        for manifest in root.glob(f"{SNAPSHOTS_PREFIX}/*/{MANIFEST_NAME}")
        for key in json.loads(manifest.read_text())["segments"]
    }

    def stored() -> set[str]:
        return {p.relative_to(root).as_posix() for p in (root / DATA_SEGMENTS_PREFIX).iterdir()}

    # the killed publisher's segment is younger than the orphan grace: kept (it might have
    # been another incarnation's publication in flight); past the grace it is collected
    assert listed and stored() > listed
    # the ledger sidecar's and metadata.json's chain chunks are written and kept the same way
    assert any(key.endswith(".json") for key in listed)
    store = ManifestStore(open_storage(f"file://{root}"), "crash")
    store.collect_segments(now=time.time() + 365 * 86_400)  # past any orphan grace
    assert stored() == listed


def test_kill_at_a_random_moment_resumes_and_audits(single_turn: Path, tmp_path: Path) -> None:
    result = _campaign(single_turn, tmp_path / "run", kills=1, seed=7, compare=False)
    _assert_whole(result, 1)


def test_deterministic_run_killed_ends_bit_identical(single_turn: Path, tmp_path: Path) -> None:
    """With zero-variance drops on: groups are dropped and replaced in the reference run and
    in the killed one (the audit finds dropped prompts), and the weights still match."""
    result = _campaign(single_turn, tmp_path / "run", kills=1, seed=3, compare=True)
    _assert_whole(result, 1)
    assert result.weights_match is True, result.to_json()
    # The reference is also the baseline of the trace's lost progress, reported per kill.
    assert result.to_json()["lost_progress_s"][0] is not None, result.to_json()
    reference = read_metrics(tmp_path / "run" / REFERENCE_DIR)
    assert sum(r["replacements"] for r in reference) > 0, reference
    assert result.audit["prompts"]["dropped"] > 0, result.audit


def _assert_startup_reported(run_dir: Path) -> None:
    """The resumed trainer reports its start-up phases in order, from the process's start,
    and reached its first redispatch without importing torch._dynamo (1.5-2 s of CPU)."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events

    done = [
        e for e in read_events(run_dir / "rollout_trace.jsonl") if e["event"] == "restore_completed"
    ]
    assert done, "no resumed incarnation"
    for event in done:
        phases = event["startup"]
        assert list(phases)[:2] == ["process_started", "command_loaded"], phases
        times = [t for t, _cpu in phases.values()]
        assert times == sorted(times), phases
        assert {"torch_imported", "restore_read", "workers_refit", "relaunched"} <= set(phases)
        assert event["dynamo_imported"] is False, event


def test_killed_before_the_first_checkpoint_resumes_at_version_0_bit_identical(
    tmp_path: Path,
) -> None:
    """SIGKILL right after a snapshot at weight version 0 published (each tool call takes
    2.5 s, so the 1 s snapshot timer fires before step 1 commits): the next incarnation
    resumes at the version its generation workers already hold. It used to exit on
    ``refit to version 0 but version 0 is installed``, on every restart; now it ends with
    the weights of an uninterrupted run, bit for bit."""
    config = write_config(
        tmp_path / "slow-first-step.yaml",
        SINGLE_TURN,
        task={"turnDelayMs": 2500},
        grpo={"maxSteps": 2},
    )
    site = FIRST_CHECKPOINT_SITES[0]
    result = _campaign(config, tmp_path / "run", kills=1, site=site, compare=True, seed=1)
    _assert_whole(result, 1)
    _assert_site_kill(result, site)
    assert result.kills[0].steps_at_kill == 0, result.to_json()
    assert result.weights_match is True, result.to_json()
    _assert_startup_reported(tmp_path / "run")


def _assert_no_gym_left_busy(run_dir: Path) -> None:
    """No incarnation was refused by a Gym still holding a killed trainer's checkpoint."""
    logs = [*sorted(run_dir.glob("chaos-trainer-*.log")), run_dir / "snapshots.jsonl"]
    for path in logs:
        assert "busy with checkpoint" not in path.read_text(), path


def test_a_kill_inside_the_gym_phase_leaves_the_next_trainer_free(
    multi_turn: Path, tmp_path: Path
) -> None:
    """Killed between prepare and commit, the trainer leaves its Gym prepared: the next
    incarnation's restore ends that checkpoint at once, restores the turn-level episodes and
    publishes snapshots, instead of being refused until the lease runs out."""
    site = "during_gym_commit:2"
    result = _campaign(multi_turn, tmp_path / "run", kills=1, site=site, compare=False, seed=2)
    _assert_whole(result, 1)
    _assert_site_kill(result, site)
    _assert_no_gym_left_busy(tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "snapshots.jsonl").open()]
    after_kill = [r for r in records if r["t"] > result.kills[0].killed_at]
    assert any(r["rollout/checkpoint_outcome"] == "published" for r in after_kill), after_kill


def test_an_asynchronous_turn_level_run_killed_at_random_audits_clean(
    async_multi_turn: Path, tmp_path: Path
) -> None:
    """Issue 10, finding 11: an asynchronous turn-level run (two Gym replicas) killed at two
    random moments resumes each time and its audit holds: no prompt lost or trained twice,
    no side effect applied twice, every gym_attempt consistent, no orphaned row."""
    result = _campaign(async_multi_turn, tmp_path / "run", kills=2, seed=7, compare=False)
    _assert_whole(result, 2)
    audit = result.audit
    assert audit["side_effects_duplicated"] == 0 and audit["side_effects"]["ok"], audit
    assert audit["side_effects"]["applied"] > 0 and audit["gym_attempts"]["ok"], audit


@pytest.mark.chaos
@pytest.mark.parametrize("site", OTHER_SITES)
def test_kill_at_every_other_site(site: str, single_turn: Path, tmp_path: Path) -> None:
    kills = _kills_for(site)
    if site.startswith("during_segment_gc"):  # orphans: a snapshot after every step
        single_turn = write_config(
            tmp_path / "every-step.yaml", SINGLE_TURN, checkpointing={"snapshotEverySteps": 1}
        )
    result = _campaign(single_turn, tmp_path / "run", kills=kills, site=site, compare=False, seed=2)
    _assert_whole(result, kills)
    _assert_site_kill(result, site)


@pytest.mark.chaos
@pytest.mark.parametrize("site", GYM_SITES)
def test_kill_at_a_gym_site_of_a_turn_level_run(
    site: str, multi_turn: Path, tmp_path: Path
) -> None:
    kills = _kills_for(site)
    result = _campaign(multi_turn, tmp_path / "run", kills=kills, site=site, compare=False, seed=2)
    _assert_whole(result, kills)
    _assert_site_kill(result, site)
    _assert_no_gym_left_busy(tmp_path / "run")


@pytest.mark.chaos
@pytest.mark.parametrize("seed", [11, 12])
def test_random_campaign_stays_whole_and_bit_identical(
    seed: int, single_turn: Path, tmp_path: Path
) -> None:
    result = _campaign(single_turn, tmp_path / "run", kills=4, seed=seed, compare=True)
    _assert_whole(result, 4)
    assert result.weights_match is True


@pytest.mark.chaos
def test_random_campaign_of_a_turn_level_run(multi_turn: Path, tmp_path: Path) -> None:
    result = _campaign(multi_turn, tmp_path / "run", kills=3, seed=5, compare=True)
    _assert_whole(result, 3)
    assert result.weights_match is True


@pytest.mark.chaos
def test_planned_kills_of_a_turn_level_run_snapshotting_by_rollouts_end_bit_identical(
    tmp_path: Path,
) -> None:
    """Issue 15: a deterministic turn-level run that snapshots by rollout progress
    (``snapshotEveryRollouts``), killed right after a trainer checkpoint and near the end of
    a step, resumes its episodes at their turn (finished ones handed back by the replica) and
    ends bit-identical to an uninterrupted run, its audit whole."""
    config = write_config(
        tmp_path / "by-rollouts.yaml",
        MULTI_TURN,
        checkpointing={"snapshotIntervalSeconds": 0, "snapshotEveryRollouts": 4},
    )
    result = _campaign(config, tmp_path / "run", kills=2, kill_at=[2.05, 4.9], compare=True)
    _assert_whole(result, 2)
    assert [k.how for k in result.kills] == ["planned", "planned"]
    assert result.weights_match is True
    records = [json.loads(line) for line in (tmp_path / "run" / "snapshots.jsonl").open()]
    assert {r["reason"] for r in records} >= {"rollout_progress"}

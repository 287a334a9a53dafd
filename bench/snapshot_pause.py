"""The pause and write parts of ``bench.rollout_checkpoint`` (``--parts pause``, ``write``).

What: forced snapshots of a real controller (ledger, replay buffer, data plane) whose rollout
pump left N finalized groups buffered, on a real ``file://`` manifest store: the pump's pause
per snapshot (barrier wait + exclusive cut held), the loop's CPU time in the cut, the cyclic GC
passes that ran meanwhile, and the write + publish off the pump; with churn (groups trained
and finalized, or rows replaced) between snapshots as a run changes them. The side-by-side
forms run each size in a fresh process per tree (``bench.rollout_checkpoint --pause-one`` /
``--write-one``), the trees alternating.

Why measured: the pause is all a snapshot costs the rollouts (they wait only while the cut is
held), and the write must finish well inside the snapshot interval or snapshots fall behind;
both grow with the buffered groups, hence 100 to 10,000 of them (the goals are in
``bench.rollout_checkpoint``'s docstring and report).

Why its own module: these parts need only a filled controller and its snapshotter, no run,
while the other parts are whole runs and kill campaigns; the filled controller is also what
``bench/snapshot_writer_cpu.py`` and the incremental-capture tests build. The command line,
its defaults and the JSON report stay ``bench.rollout_checkpoint``'s, which names every goal.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.tiny_run import TINY
from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import FinalizerResult
from rolloutrun_runtime.algorithms.single_controller import SingleController
from rolloutrun_runtime.algorithms.trainer_checkpoint import TrainerCheckpointer
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.experience.rollout_recovery import (
    Granularity,
    PromptRef,
    RestoreLevel,
    sibling_id_for,
)
from rolloutrun_runtime.storage import open_storage

GROUP_SIZE = 4
TOKENS = 24


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "p50_ms": round(pick(0.50) * 1000, 3),
        "p99_ms": round(pick(0.99) * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
        "n": len(ordered),
    }


# --------------------------------------------------------------------------- pause
def _row(rng: np.random.Generator) -> dict[str, Any]:
    mask = np.zeros(TOKENS, dtype=np.int64)
    mask[TOKENS // 2 :] = 1
    return {
        "input_ids": rng.integers(0, 30, TOKENS, dtype=np.int64),
        "behaviour_logprobs": rng.standard_normal(TOKENS).astype(np.float32),
        "weight_versions": np.zeros(TOKENS, dtype=np.int64),
        "loss_mask": mask,
        "reward": float(rng.random()),
        "model_tokens": int(mask.sum()),
        "instance_id": "gym-0",
    }


def _add_group(
    controller: SingleController, cut: Any, index: int, rng: np.random.Generator
) -> None:
    """Group ``pg<index>`` reserved, generated, finalized and buffered (as the rollout pump
    leaves it: its rows in the data plane, its finalizer result kept)."""
    ledger = controller.ledger
    assert ledger is not None
    group_id = f"pg{index:06d}"
    prompt = PromptRef(index % 64, index // 64, index % 64)
    ledger.reserve_group(
        cut,
        group_id=group_id,
        admission_id="step1",
        prompt=prompt,
        target_step=1,
        start_weight_version=0,
        group_size=GROUP_SIZE,
        granularity=Granularity.SIBLING,
        restore_level=RestoreLevel.SIBLING,
    )
    ledger.admit(cut, group_id)
    group = ledger.group(group_id)
    for sibling in group.siblings:
        attempt = sibling.current
        ledger.dispatch(cut, sibling.sibling_id, attempt.attempt_uuid, "gym-0")
        ledger.seal(
            cut,
            sibling.sibling_id,
            attempt.attempt_uuid,
            reward=float(rng.random()),
            row_key=attempt.episode.capture_key,
        )
    ledger.begin_finalize(cut, group_id)
    keys = []
    for sibling in group.siblings:
        key = sibling_id_for(group_id, sibling.index)
        controller.data_plane.put("train", key, _row(rng))
        keys.append(key)
    ledger.finish_finalize(cut, group_id)
    controller.buffer.add(
        ReplayGroup(group_id, prompt.prompt_id, 1, tuple(keys), (0.0,) * GROUP_SIZE, 48)
    )
    # as the rollout pump leaves it: one finalizer result per buffered group
    controller.state.runtime_state.finalizer_results[group_id] = FinalizerResult(
        group_id, 1, [0.0] * GROUP_SIZE, 48, {0: 48}
    )


async def _churn(controller: SingleController, first: int, count: int, step: int) -> None:
    """What a run changes between two snapshots: the ``count`` oldest buffered groups trained
    (gone from the ledger, the buffer, the data plane and the finalizer results) and as many
    new groups finalized, numbered from ``first``."""
    ledger = controller.ledger
    assert ledger is not None
    trained = [group.group_id for group in controller.buffer.groups()[:count]]
    rng = np.random.default_rng(first)
    async with controller.barrier.mutation("bench_churn") as cut:
        ledger.claim(cut, trained, step)
        ledger.remove_trained(cut, trained, step)
        for group in controller.buffer.take(trained):
            controller.data_plane.clear("train", group.row_keys)
            controller.state.runtime_state.finalizer_results.pop(group.group_id, None)
        for index in range(first, first + count):
            _add_group(controller, cut, index, rng)


async def _filled_controller(groups: int, root: Path) -> SingleController:
    """A real controller whose ledger, replay buffer and data plane hold ``groups`` groups."""
    import torch

    from rolloutrun_runtime.policy.model import build_model
    from rolloutrun_runtime.policy.tokenizer import TOKENIZER
    from rolloutrun_runtime.workers import build_workers

    data = json.loads(json.dumps(TINY))
    data["logDir"] = str(root)
    data["rollout"]["replayCapacity"] = max(groups, 16)
    data["checkpointing"]["snapshotIntervalSeconds"] = 0
    data["checkpointing"]["targetLevel"] = "sibling"  # no environment phase: the pump's share
    cfg = RunConfig.model_validate(data)
    model = build_model(cfg.policy, TOKENIZER.vocab_size, cfg.seed)
    storage = open_storage("file://" + str(root / "checkpoints"))
    controller = SingleController(
        cfg,
        model=model,
        optimizer=torch.optim.Adam(model.parameters()),
        workers=build_workers(cfg, model.state_dict(), 0),
        gym_endpoints=["http://127.0.0.1:9"],
        checkpointer=TrainerCheckpointer(storage, 2),
        manifests=ManifestStore(storage, cfg.name),
        gym_token="bench",  # never used: the bench dispatches nothing
    )
    ledger = controller.ledger
    assert ledger is not None
    # The trainer's start-up: its heap (torch, the model) is frozen out of cyclic GC.
    gc.collect()
    gc.freeze()
    rng = np.random.default_rng(0)
    async with controller.barrier.mutation("prompt_reservations") as cut:
        for index in range(groups):
            _add_group(controller, cut, index, rng)
    controller.rollout_snapshots.ensure_bootstrap_anchor()
    return controller


async def _pause_samples(groups: int, repeats: int, churn: int = 0) -> dict[str, Any]:
    """Forced snapshots of a filled controller; with ``churn``, that many groups trained and
    as many finalized before each (what a run changes between snapshots)."""
    with tempfile.TemporaryDirectory(prefix="rr-bench-pause-") as tmp:
        controller = await _filled_controller(groups, Path(tmp))
        records: list[dict[str, Any]] = []
        snapshotter = controller.rollout_snapshots
        snapshotter._on_record = records.append  # the trainer's hook writes snapshots.jsonl
        passes: list[float] = []
        started: list[float] = []

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[:] = [time.perf_counter()]
            elif started:
                passes.append(time.perf_counter() - started[0])

        gc.callbacks.append(on_gc)
        try:
            for repeat in range(repeats):
                if churn and repeat:
                    await _churn(controller, groups + repeat * churn, churn, repeat)
                await snapshotter.attempt(force=True, reason="bench")
        finally:
            gc.callbacks.remove(on_gc)
            gc.unfreeze()
        published = [r for r in records if r.get("rollout/checkpoint_outcome") == "published"]
        if not published:
            raise RuntimeError(f"no snapshot published at {groups} groups: {records[-1:]}")
        pauses = [r["timing/rollout_checkpoint"]["pump_paused_s"] for r in published]
        held = [r["timing/rollout_checkpoint"]["cut_held_s"] for r in published]
        writes = [
            r["timing/rollout_checkpoint"]["write_s"] + r["timing/rollout_checkpoint"]["publish_s"]
            for r in published
        ]
        # the loop thread's CPU time in the cut (0 where the runtime does not report it)
        cpu = [r["timing/rollout_checkpoint"].get("cut_held_cpu_s", 0.0) for r in published]
        return {
            "groups": groups,
            "churn_groups": churn,
            "pause": _percentiles(pauses),
            "cut_held": _percentiles(held),
            "cut_held_cpu": _percentiles(cpu),
            "write_and_publish_off_pump": _percentiles(writes),
            "gc_passes": {
                "n": len(passes),
                "over_10ms": sum(1 for p in passes if p > 0.010),
                "max_ms": round(max(passes, default=0.0) * 1000, 3),
            },
        }


def _pause_side_by_side(
    sizes: tuple[int, ...], repeats: dict[int, int], baseline: str, churn: int = 0
) -> dict:
    """The pause part against another checkout's runtime (e.g. ``git archive main``) in
    the same session: each size runs in a fresh process per tree, the trees alternating."""
    import os
    import subprocess

    here = Path(__file__).resolve().parent.parent
    trees = {"baseline": Path(baseline).resolve(), "this_tree": here}
    out: dict[str, Any] = {"baseline_tree": str(trees["baseline"]), "by_groups": []}
    for groups in sizes:
        row: dict[str, Any] = {"groups": groups}
        for name, tree in trees.items():
            path = os.pathsep.join([str(here), str(tree / "runtime"), str(tree / "operator")])
            command = [sys.executable, "-m", "bench.rollout_checkpoint", "--pause-one"]
            done = subprocess.run(
                [*command, str(groups), "--repeats", str(repeats[groups])]
                + (["--pause-churn", str(churn)] if churn else []),
                env={**os.environ, "PYTHONPATH": path},
                cwd=here,
                check=True,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            row[name] = json.loads(done.stdout)
        out["by_groups"].append(row)
    return out


def _pause_goals(rows: list[dict[str, Any]], interval_s: float = 10.0) -> dict[str, Any]:
    """The pause goals against this tree's rows: p99 <= 10 ms at 1,000 groups, <= 25 ms at
    10,000, write + publish off the pump <= a quarter of the (default) snapshot interval."""
    by = {row["groups"]: row for row in rows}
    goals: dict[str, Any] = {}
    for groups, limit_ms in ((1000, 10.0), (10_000, 25.0)):
        if groups in by:
            p99 = by[groups]["pause"]["p99_ms"]
            goals[f"pause_p99_at_{groups}"] = {"p99_ms": p99, "goal_ms": limit_ms}
            goals[f"pause_p99_at_{groups}"]["met"] = p99 <= limit_ms
    if 10_000 in by:
        p50 = by[10_000]["write_and_publish_off_pump"]["p50_ms"]
        goal = interval_s * 1000 / 4
        goals["write_publish_at_10000"] = {"p50_ms": p50, "goal_ms": goal, "met": p50 <= goal}
    return goals


# --------------------------------------------------------------------------- write
#: ``--parts write``: groups whose rows are replaced between snapshots (new rows to write).
WRITE_CHURN_GROUPS = 40


async def _write_samples(groups: int, repeats: int, churn: int, pre_cut_yield: bool) -> dict:
    """Write + publish off the pump and the pause (wall, loop CPU, preemptions in the cut)
    per forced snapshot, ``churn`` groups' rows replaced before each (what a run adds
    between snapshots); this process's runtime."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing import snapshots as module

    if not pre_cut_yield and hasattr(module, "PRE_CUT_YIELD_S"):
        module.PRE_CUT_YIELD_S = 0.0
    with tempfile.TemporaryDirectory(prefix="rr-bench-write-") as tmp:
        controller = await _filled_controller(groups, Path(tmp))
        records: list[dict[str, Any]] = []
        controller.rollout_snapshots._on_record = records.append
        rng = np.random.default_rng(1)
        keys = controller.data_plane.list("train")
        try:
            await controller.rollout_snapshots.attempt(force=True, reason="bench")  # the base
            for _ in range(repeats):
                async with controller.barrier.mutation("bench"):
                    for index in rng.choice(len(keys), churn * GROUP_SIZE, replace=False):
                        controller.data_plane.put("train", keys[index], _row(rng))
                await controller.rollout_snapshots.attempt(force=True, reason="bench")
        finally:
            gc.unfreeze()
    published = [r for r in records[1:] if r.get("rollout/checkpoint_outcome") == "published"]
    if not published:
        raise RuntimeError(f"no snapshot published at {groups} groups: {records[-1:]}")
    timing = [r["timing/rollout_checkpoint"] for r in published]
    return {
        "groups": groups,
        "churn_groups": churn,
        "write_and_publish": _percentiles([t["write_s"] + t["publish_s"] for t in timing]),
        "pause_wall": _percentiles([t["pump_paused_s"] for t in timing]),
        "pause_cpu": _percentiles([t.get("cut_held_cpu_s", 0.0) for t in timing]),
        "cuts_preempted": sum(1 for t in timing if t.get("cut_preempted", 0) > 0),
        "rows_written_p50": sorted(r.get("data_plane_rows_written", -1) for r in published)[
            len(published) // 2
        ],
    }


def _write_side_by_side(sizes: tuple[int, ...], repeats: int, baseline: str) -> dict:
    """``_write_samples`` for the baseline tree, this tree, and this tree without the pre-cut
    yield, each size in a fresh process per variant, the variants alternating (one run)."""
    import subprocess

    here = Path(__file__).resolve().parent.parent
    variants = {
        "baseline": (Path(baseline).resolve(), []),
        "this_tree": (here, []),
        "this_tree_no_pre_cut_yield": (here, ["--no-pre-cut-yield"]),
    }
    out: dict[str, Any] = {"baseline_tree": str(variants["baseline"][0]), "by_groups": []}
    for groups in sizes:
        row: dict[str, Any] = {"groups": groups}
        for name, (tree, extra) in variants.items():
            path = os.pathsep.join([str(here), str(tree / "runtime"), str(tree / "operator")])
            command = [sys.executable, "-m", "bench.rollout_checkpoint", "--write-one"]
            done = subprocess.run(
                [*command, str(groups), "--repeats", str(repeats), *extra],
                env={**os.environ, "PYTHONPATH": path},
                cwd=here,
                check=True,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            row[name] = json.loads(done.stdout)
        out["by_groups"].append(row)
    by = {row["groups"]: row["this_tree"] for row in out["by_groups"]}
    goals: dict[str, Any] = {}
    for groups, limit_ms in ((1000, 10.0), (10_000, 25.0)):
        if groups in by:
            p99 = by[groups]["pause_wall"]["p99_ms"]
            goals[f"pause_p99_at_{groups}"] = {"p99_ms": p99, "goal_ms": limit_ms}
            goals[f"pause_p99_at_{groups}"]["met"] = p99 <= limit_ms
    if 10_000 in by:
        p50 = by[10_000]["write_and_publish"]["p50_ms"]
        goals["write_publish_at_10000"] = {"p50_ms": p50, "goal_ms": 2500.0, "met": p50 <= 2500}
    out["goals"] = goals
    return out

"""Rollout-checkpoint benchmark: pump pause, throughput cost, thrown-away work, resume time.

Everything is measured side by side in one run and printed as JSON, each goal next to its
baseline from the same run:

- **pause**: the rollout pump's pause per snapshot (barrier wait + exclusive cut held,
  ``timing/rollout_checkpoint.pump_paused_s``) with 100, 1,000 and 10,000 finalized
  groups buffered, on a real controller (ledger, replay buffer, data plane) and a real
  ``file://`` manifest store; p50/p99 over repeated forced snapshots. Goal: p99 <= 100 ms at
  1,000. Like the trainer, the bench freezes its start-up heap out of cyclic GC (the
  buffered groups, made after, are not frozen) and reports the GC passes that ran during
  the attempts (they block the event loop whether or not a cut is held).
- **throughput**: the tiny config with a snapshot after every step (``snapshotEverySteps: 1``)
  against none, switched on and off in short blocks inside each run (ABBA order, a guard
  step per block), so both sides share the process, its start-up and the machine's drift;
  the ratio is the geometric mean over on/off block pairs of off's step time over on's, with
  a 95 % t interval, and the CPU ratio likewise (:mod:`bench.throughput_blocks`;
  ``--throughput-baseline DIR`` runs another checkout's runs alternating with this tree's).
  Goal: ratio >= 0.995, met only if the interval's low end reaches it (null: inconclusive).
- **thrown-away work**: ``rolloutrun chaos`` on the same config at ``savePeriod: 10``,
  snapshots (after every step, every second and every 8 rollouts dispatched) against
  snapshots off (restart from trainer checkpoints only),
  over several kill seeds (default 1-5, six kills each). A seed fixes its kill moments in
  run progress (:func:`kill_moments`: one right after a trainer checkpoint, one right
  before one, the rest uniform over the whole run), the same for both sides, which run back
  to back in this one invocation. Per seed: rollout seconds lost per kill
  (``rollout_work_lost_s``) and per kill where it went (seconds since the restored cut,
  attempts in flight, abandoned, restored at their turn); per side the mean, spread and
  worst seed; the ratio per seed, and the goal stated at the worst one: >= 20x less.
- **resume**: from a resumed trainer's ``run_started`` to its first ``attempt_dispatched``
  (and from the process launch, which adds interpreter and torch start-up). Goal: <= 5 s.
- **pause side by side** (``--pause-baseline DIR``, e.g. ``git archive`` of the base commit):
  the pause part for each size in a fresh process per tree, trees alternating; each row also
  reports the loop's CPU time in the cut (``cut_held_cpu``), which a shared machine does not
  inflate. Goals (``pause.goals``): p99 <= 10 ms at 1,000 groups, <= 25 ms at 10,000, write +
  publish off the pump <= a quarter of the default snapshot interval at 10,000.
  ``--pause-churn N``: before each snapshot N groups trained and N new ones finalized (what a
  run changes between snapshots; 0 = nothing changes); ``--pause-repeats-10k N``: samples at
  10,000 groups (default 5, whose p99 is their max).
- **write** (``--parts write --write-baseline DIR [--repeats N]``): per forced snapshot with
  ``WRITE_CHURN_GROUPS`` groups' rows replaced before each, write + publish off the pump and
  the pause (wall clock, loop CPU in the cut, cuts the OS preempted) at 1,000 and 10,000
  groups, for the baseline tree, this tree and this tree without the pre-cut yield, each in
  a fresh process, alternating. Goals: pause p99 <= 10 / 25 ms, write + publish p50 at
  10,000 <= 2.5 s (a quarter of the default snapshot interval).
- **startup** (``--parts startup --startup-baseline DIR``): process launch -> first
  redispatch of resumed trainers in short kill campaigns, per tree, on the pod path (the
  run's Lease on a local API server), as ``bench/startup_breakdown.py`` measures it.
  Goal: <= 2 s at the worst sample.
- **startup_breakdown** (``--parts startup_breakdown --startup-baseline DIR``): the same,
  phase by phase (wall and CPU seconds per start-up phase, p50 and worst, and the heaviest
  top-level imports), per tree: ``bench/startup_breakdown.py``.

The pause and write parts live in :mod:`bench.snapshot_pause`; :mod:`bench.tiny_run` holds
the run config every part starts from. This module keeps the command line and the report.

Usage: ``python -m bench.rollout_checkpoint [--quick] [--seeds 1 2 3 4 5] [--kills 6]
[--parts pause,throughput,thrown_away] [--keep DIR] [--out FILE]``. ``--quick`` (for every
change to the checkpointing path; ``tests/bench`` runs it) is the pause at 100 and 1,000
groups and one seed's two kills on an 8-step run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

# Run as a file (``python bench/rollout_checkpoint.py``) only bench/ itself is on the path,
# not the repository root its ``bench.*`` imports need (as a module, it already is).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The pause and write parts, and the run config every part shares; GROUP_SIZE, _churn,
# _filled_controller, _row and TINY stay importable from here (tests and other benches do).
from bench.snapshot_pause import GROUP_SIZE as GROUP_SIZE
from bench.snapshot_pause import (
    WRITE_CHURN_GROUPS,
    _pause_goals,
    _pause_samples,
    _pause_side_by_side,
    _write_samples,
    _write_side_by_side,
)
from bench.snapshot_pause import _churn as _churn
from bench.snapshot_pause import _filled_controller as _filled_controller
from bench.snapshot_pause import _row as _row
from bench.tiny_run import TINY
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.chaos import run_chaos
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.run_config import RunConfig

#: Lost rollout time per kill, trainer checkpoints only over snapshots, at the worst seed.
GOAL_REDUCTION = 20.0
#: The seeds of the full run (each: both sides, the same kill moments).
SEEDS = [1, 2, 3, 4, 5]
#: ``--quick``'s kill runs: this many steps, kills and savePeriod.
QUICK_STEPS = 8
QUICK_KILLS = 2
QUICK_SAVE_PERIOD = 4


# --------------------------------------------------------------------------- runs
def _config(path: Path, max_steps: int | None = None, **checkpointing: Any) -> Path:
    data = json.loads(json.dumps(TINY))
    data["checkpointing"].update(checkpointing)
    if max_steps is not None:
        data["grpo"]["maxSteps"] = max_steps
    path.write_text(yaml.safe_dump(data))
    return path


def _throughput(
    root: Path, runs: int, baseline: str | None, quick: bool, baseline_runs: int | None = None
) -> dict[str, Any]:
    """Snapshot after every step vs none: on/off blocks inside each run, the trees' runs
    interleaved; the paired ratio's 95 % interval against the goal (bench.throughput_blocks)."""
    from bench.throughput_blocks import CYCLES, measure

    cycles = 2 if quick else CYCLES
    return measure(
        TINY, root, baseline=baseline, runs=runs, baseline_runs=baseline_runs, cycles=cycles
    )


def _resume_times(log_dir: Path, launched_at: list[float]) -> dict[str, Any]:
    """Per resumed incarnation: run_started -> first dispatch, and process launch -> it."""
    events = sorted(read_events(log_dir / TRACE_FILE), key=lambda e: e["t"])
    by_run: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        by_run.setdefault(event["run_id"], []).append(event)
    from_start: list[float] = []
    from_launch: list[float] = []
    for run_events in by_run.values():
        started = next((e for e in run_events if e["event"] == "run_started"), None)
        if started is None or not started.get("resumed_from"):
            continue
        first = next((e for e in run_events if e["event"] == "attempt_dispatched"), None)
        if first is None:
            continue
        from_start.append(first["t"] - started["t"])
        launch = max((t for t in launched_at if t <= started["t"]), default=None)
        if launch is not None:
            from_launch.append(first["t"] - launch)
    return {
        "run_started_to_first_dispatch_s": [round(v, 3) for v in from_start],
        "launch_to_first_dispatch_s": [round(v, 3) for v in from_launch],
        "max_s": round(max(from_start), 3) if from_start else None,
        "max_from_launch_s": round(max(from_launch), 3) if from_launch else None,
        "goal": "<= 5 s (run_started, i.e. after interpreter and torch start-up)",
        "met": bool(from_start) and max(from_start) <= 5.0,
    }


#: Kill moments right after / right before a trainer checkpoint: this far past the step
#: that saves it, or this far before that step completes (fractions of a step).
NEAR_CHECKPOINT = 0.05


def kill_moments(seed: int, kills: int, max_steps: int, save_period: int) -> list[float]:
    """A seed's kill moments in run progress (train steps, as ``run_chaos(kill_at=...)``):
    one right after a trainer checkpoint, one right before one, the rest uniform over the
    whole run; sorted, at least a step apart. Both sides of a seed get the same moments."""
    rng = random.Random(seed)
    # The steps that save a trainer checkpoint (maxSteps, the last, only to be killed before).
    saves = list(range(save_period, max_steps + 1, save_period)) or [max_steps]
    inside = [m for m in saves if m < max_steps] or [max_steps - 1]
    for _ in range(10_000):
        moments: list[float] = []
        if kills >= 1:
            moments.append(rng.choice(inside) + NEAR_CHECKPOINT)
        if kills >= 2:
            moments.append(rng.choice(saves) - NEAR_CHECKPOINT)
        while len(moments) < kills:
            moments.append(round(rng.uniform(1.0, max_steps - 1.0), 3))
        moments.sort()
        if all(b - a >= 1.0 for a, b in itertools.pairwise(moments)):
            return moments
    raise ValueError(f"{kills} kills a step apart do not fit in {max_steps} steps")


def spread(values: dict[int, float], worst: str) -> dict[str, Any]:
    """Mean, spread and the worst seed of per-seed values (``worst``: ``max`` or ``min``)."""
    pick = max if worst == "max" else min
    seed = pick(values, key=lambda s: values[s])
    numbers = list(values.values())
    return {
        "mean": round(statistics.fmean(numbers), 3),
        "stdev": round(statistics.stdev(numbers), 3) if len(numbers) > 1 else 0.0,
        "min": round(min(numbers), 3),
        "max": round(max(numbers), 3),
        "worst_seed": seed,
        "worst": round(values[seed], 3),
    }


def _kill_rows(data: dict[str, Any], log_dir: Path) -> list[dict[str, Any]]:
    """Per kill: where it landed, what it lost and why (the trace's stop report)."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import analyze

    trace = log_dir / TRACE_FILE
    stops = analyze(list(read_events(trace))).stops if trace.exists() else []
    rows = []
    for kill in data["kill_details"]:
        stop = next((s for s in stops if s.resume_time >= kill["killed_at"] - 1e-3), None)
        rows.append(
            {
                "steps_at_kill": kill["steps_at_kill"],
                "how": kill["how"],
                "lost_s": round(kill["rollout_work_lost_s"], 3),
                "restored_from": (kill["restored_from"] or "fresh").rstrip("/").split("/")[-2:],
                "since_cut_s": None
                if stop is None or stop.since_cut_s is None
                else round(stop.since_cut_s, 3),
                "in_flight_at_stop": None if stop is None else stop.in_flight_at_stop,
                "abandoned": None if stop is None else stop.abandoned_attempts,
                "restored_at_turn": None if stop is None else stop.restored_attempts,
            }
        )
    return rows


def _one_side(root: Path, name: str, every: int, seed: int, kills: int) -> dict[str, Any]:
    config = _config(
        root / f"chaos-{name}.yaml",
        snapshotIntervalSeconds=every,
        snapshotEverySteps=every,
        snapshotEveryRollouts=every * SNAPSHOT_EVERY_ROLLOUTS,
    )
    cfg = RunConfig.model_validate(yaml.safe_load(config.read_text()))
    moments = kill_moments(seed, kills, cfg.grpo.max_steps, cfg.checkpointing.save_period)
    log_dir = root / f"chaos-{name}-s{seed}"
    result = run_chaos(config, log_dir, kills=kills, seed=seed, compare=False, kill_at=moments)
    data = result.to_json()
    lost = data["rollout_work_lost_s"]
    return {
        "kill_at": moments,
        "kills": data["kills"],
        "audit_ok": data["audit"].get("ok"),
        "mean_lost_s_per_kill": round(statistics.fmean(lost), 3) if lost else None,
        "per_kill": _kill_rows(data, log_dir),
        "resume": _resume_times(log_dir, data["incarnations_launched_at"]),
    }


SIDES = (("snapshots", 1), ("trainer_checkpoints_only", 0))
#: The snapshot side's cadence by rollout progress: half the attempts the run has in flight.
SNAPSHOT_EVERY_ROLLOUTS = 8


def _thrown_away(root: Path, kills: int, seeds: list[int]) -> dict[str, Any]:
    """Both sides over every seed, in this one run (seed by seed, the sides back to back)."""
    per_seed: dict[str, dict[int, dict[str, Any]]] = {name: {} for name, _ in SIDES}
    for seed in seeds:
        for name, every in SIDES:
            per_seed[name][seed] = _one_side(root, name, every, seed, kills)
            print(
                f"seed {seed} {name}: {per_seed[name][seed]['mean_lost_s_per_kill']} s/kill",
                file=sys.stderr,
            )
    return summarize(per_seed)


def summarize(per_seed: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per side: per-seed rows, mean, spread and worst seed; the ratio per seed and at the
    worst seed (the goal), and worst against worst (the strictest reading)."""
    out: dict[str, Any] = {}
    means: dict[str, dict[int, float]] = {}
    for name, rows in per_seed.items():
        means[name] = {s: r["mean_lost_s_per_kill"] or 0.0 for s, r in rows.items()}
        out[name] = {
            "per_seed": {str(s): r for s, r in rows.items()},
            "lost_s_per_kill": spread(means[name], "max" if name == "snapshots" else "min"),
            "audit_ok": all(r["audit_ok"] for r in rows.values()),
        }
    snap, base = means["snapshots"], means["trainer_checkpoints_only"]
    ratios = {s: base[s] / snap[s] if snap[s] else float("inf") for s in snap}
    worst = min(ratios, key=lambda s: ratios[s])
    out["ratio_per_seed"] = {str(s): round(r, 2) for s, r in ratios.items()}
    out["reduction"] = round(ratios[worst], 2)
    out["reduction_worst_seed"] = worst
    worst_snap = max(snap.values())
    out["reduction_worst_vs_worst"] = (
        round(min(base.values()) / worst_snap, 2) if worst_snap else None
    )
    out["goal"] = (
        f">= {GOAL_REDUCTION:g}x less lost rollout time per kill (savePeriod 10) at the worst "
        f"of the seeds (the per-seed ratio of means)"
    )
    out["met"] = bool(ratios[worst] >= GOAL_REDUCTION)
    return out


def _startup_one(root: Path, kills: int, seed: int) -> dict[str, Any]:
    """Process launch -> first redispatch of resumed trainers (this process's runtime): a
    short kill campaign with snapshots after every step, without a Lease (``--startup-one``;
    the side-by-side figure runs the pod path, see :func:`_startup_side_by_side`)."""
    config = _config(root / "startup.yaml", 8, snapshotIntervalSeconds=1, snapshotEverySteps=1)
    result = run_chaos(config, root / "startup", kills=kills, seed=seed, compare=False)
    return _resume_times(root / "startup", result.to_json()["incarnations_launched_at"])


def _startup_side_by_side(kills: int, seed: int, baseline: str, rounds: int) -> dict[str, Any]:
    """Start-up against another checkout's runtime in the same session, trees alternating,
    on the pod path: each trainer under the run's Lease on a local API server, both trees
    byte-compiled as an image is. The very measurement of ``bench/startup_breakdown.py``
    (whose per-phase report this leaves out), so the two benches state one figure."""
    from bench.startup_breakdown import side_by_side

    report = side_by_side(baseline, rounds, kills, seed, lease=True)
    out: dict[str, Any] = {}
    for name in ("baseline", "this_tree"):
        samples = sorted(r["launch_to_first_dispatch_s"] for r in report["raw"][name])
        out[name] = samples
        out[f"{name}_max_s"] = samples[-1] if samples else None
        out[f"{name}_median_s"] = statistics.median(samples) if samples else None
        out[f"{name}_cpu_s"] = report[name]["cpu_to_first_dispatch_s"]
        out[f"{name}_runqueue_s"] = report[name]["runqueue_to_first_dispatch_s"]
        out[f"{name}_keeper_cpu_s"] = report[name]["keeper_cpu_to_first_dispatch_s"]
    out["pod_lease"] = True
    out["machine"] = report["machine"]
    out["goal"] = "<= 2 s from process launch to the first redispatch"
    out["met"] = bool(out["this_tree"]) and max(out["this_tree"]) <= 2.0
    return out


#: The command line in ``--help``'s order: each option's flag and ``add_argument`` keywords.
_OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--quick",
        dict(
            action="store_true",
            help=f"small enough for every change to the checkpointing path: pause at 100 and "
            f"1,000 groups, thrown-away work on a {QUICK_STEPS}-step run (savePeriod "
            f"{QUICK_SAVE_PERIOD}) with {QUICK_KILLS} kills at seed 1; no throughput unless "
            f"--parts names it",
        ),
    ),
    ("--kills", dict(type=int, default=None, help="kills per seed (default 6)")),
    (
        "--seeds",
        dict(
            type=int,
            nargs="+",
            default=None,
            help=f"kill seeds (default {' '.join(map(str, SEEDS))}; --quick: 1)",
        ),
    ),
    ("--seed", dict(type=int, default=None, help="one kill seed (as --seeds S)")),
    ("--out", dict(default=None, help="also write the JSON here")),
    ("--keep", dict(default=None, metavar="DIR", help="keep the runs' log dirs under DIR")),
    (
        "--parts",
        dict(
            default=None,
            help="comma-separated parts to run (default pause,throughput,thrown_away; "
            "--quick: pause,thrown_away)",
        ),
    ),
    (
        "--pause-baseline",
        dict(
            default=None,
            help="a checkout (e.g. `git archive main`) whose runtime's pause runs side by side",
        ),
    ),
    ("--pause-one", dict(type=int, default=None, help=argparse.SUPPRESS)),
    (
        "--pause-churn",
        dict(
            type=int,
            default=0,
            help="pause part: groups trained and as many finalized before each snapshot",
        ),
    ),
    (
        "--pause-repeats-10k",
        dict(
            type=int,
            default=None,
            help="pause part: snapshots at 10,000 groups (default 5; p99 of 5 is their max)",
        ),
    ),
    ("--startup-one", dict(action="store_true", help=argparse.SUPPRESS)),
    (
        "--startup-baseline",
        dict(
            default=None,
            help="a checkout whose trainer start-up (launch -> first redispatch) runs side by side",
        ),
    ),
    ("--repeats", dict(type=int, default=5, help=argparse.SUPPRESS)),
    (
        "--target-level",
        dict(
            default="turn",
            choices=["turn", "sibling", "prompt_group"],
            help="checkpointing.targetLevel of the throughput and kill runs",
        ),
    ),
    (
        "--write-baseline",
        dict(
            default=None,
            help="a checkout whose snapshot write + publish and pause run side by side "
            "(--parts write)",
        ),
    ),
    ("--write-one", dict(type=int, default=None, help=argparse.SUPPRESS)),
    ("--no-pre-cut-yield", dict(action="store_true", help=argparse.SUPPRESS)),
    (
        "--throughput-baseline",
        dict(default=None, help="a checkout whose throughput runs alternate with this tree's"),
    ),
    (
        "--throughput-repetitions",
        dict(
            type=int,
            default=None,
            help="runs per tree of the throughput part, in complementary pairs (default 2, "
            "--quick: of 2 cycles, not 8; too few to certify a goal this close: the JSON's "
            "runs_to_certify says how many would, at the ratio and spread seen)",
        ),
    ),
    (
        "--throughput-baseline-repetitions",
        dict(
            type=int,
            default=None,
            help="runs of the --throughput-baseline checkout (default: as many as this "
            "tree's); its pairs of runs are spread evenly among this tree's",
        ),
    ),
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, options in _OPTIONS:
        parser.add_argument(flag, **options)
    args = parser.parse_args(argv)
    if args.seed is not None and args.seeds is not None:
        parser.error("--seed and --seeds are exclusive")
    args.seeds = (
        [args.seed] if args.seed is not None else args.seeds or ([1] if args.quick else SEEDS)
    )
    args.kills = args.kills if args.kills is not None else QUICK_KILLS if args.quick else 6
    default_parts = "pause,thrown_away" if args.quick else "pause,throughput,thrown_away"
    args.parts = set((args.parts or default_parts).split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.pause_one is not None:  # one size, this process's runtime (--pause-baseline)
        sample = _pause_samples(args.pause_one, args.repeats, args.pause_churn)
        print(json.dumps(asyncio.run(sample)))
        return 0
    if args.write_one is not None:  # one size, this process's runtime (--write-baseline)
        sample = _write_samples(
            args.write_one, args.repeats, WRITE_CHURN_GROUPS, not args.no_pre_cut_yield
        )
        print(json.dumps(asyncio.run(sample)))
        return 0
    if args.startup_one:  # one short campaign, this process's runtime (--startup-baseline)
        with tempfile.TemporaryDirectory(prefix="rr-bench-startup-") as tmp:
            print(json.dumps(_startup_one(Path(tmp), args.kills, args.seeds[0])))
        return 0
    parts = args.parts
    TINY["checkpointing"]["targetLevel"] = args.target_level
    if args.quick:
        TINY["grpo"]["maxSteps"] = QUICK_STEPS
        TINY["checkpointing"]["savePeriod"] = QUICK_SAVE_PERIOD
    started = time.monotonic()
    report: dict[str, Any] = {"target_level": args.target_level, "quick": args.quick}
    if "pause" in parts:
        sizes = (100, 1000) if args.quick else (100, 1000, 10_000)
        repeats = {n: 5 if n >= 10_000 or args.quick else 30 for n in sizes}
        if args.pause_repeats_10k and 10_000 in repeats:
            repeats[10_000] = args.pause_repeats_10k
        churn = args.pause_churn
        pause = [asyncio.run(_pause_samples(n, repeats[n], churn)) for n in sizes]
        at_1000 = next(p for p in pause if p["groups"] == 1000)
        report["pause"] = {
            "by_groups": pause,
            "goal": "p99 <= 100 ms at 1,000 groups",
            "met": at_1000["pause"]["p99_ms"] <= 100.0,
            "goals": _pause_goals(pause),
        }
        if args.pause_baseline:
            report["pause"]["side_by_side"] = _pause_side_by_side(
                sizes, repeats, args.pause_baseline, churn
            )
    if "write" in parts and args.write_baseline:
        sizes = (1000,) if args.quick else (1000, 10_000)
        report["write"] = _write_side_by_side(sizes, args.repeats, args.write_baseline)
    with tempfile.TemporaryDirectory(prefix="rr-bench-ckpt-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if "throughput" in parts:
            runs = args.throughput_repetitions or 2
            report["throughput"] = _throughput(
                root,
                runs,
                args.throughput_baseline,
                args.quick,
                args.throughput_baseline_repetitions,
            )
        if "startup" in parts and args.startup_baseline:
            report["startup"] = _startup_side_by_side(
                min(args.kills, 3), args.seeds[0], args.startup_baseline, 1 if args.quick else 2
            )
        if "startup_breakdown" in parts and args.startup_baseline:
            report["startup_breakdown"] = _startup_breakdown(args)
        if "thrown_away" in parts:
            thrown = _thrown_away(root, args.kills, args.seeds)
            thrown.update(
                seeds=args.seeds,
                kills_per_seed=args.kills,
                max_steps=TINY["grpo"]["maxSteps"],
                save_period=TINY["checkpointing"]["savePeriod"],
            )
            report["thrown_away"] = thrown
            report["resume"] = merge_resume(
                [r["resume"] for r in thrown["snapshots"]["per_seed"].values()]
            )
    report["machine"] = {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
    report["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=1, sort_keys=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _startup_breakdown(args: argparse.Namespace) -> dict[str, Any]:
    """Where a resumed trainer's start-up goes, phase by phase, against the baseline tree
    (``bench/startup_breakdown.py``: wall and CPU per phase, p50 and worst)."""
    from bench.startup_breakdown import side_by_side

    rounds = 1 if args.quick else 3
    return side_by_side(args.startup_baseline, rounds, 2, args.seeds[0], importtime=True)


def merge_resume(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """The resume times of every seed's resumed incarnations, as one ``_resume_times``."""
    start = [v for r in per_seed for v in r["run_started_to_first_dispatch_s"]]
    launch = [v for r in per_seed for v in r["launch_to_first_dispatch_s"]]
    return {
        "run_started_to_first_dispatch_s": start,
        "launch_to_first_dispatch_s": launch,
        "max_s": max(start) if start else None,
        "max_from_launch_s": max(launch) if launch else None,
        "goal": "<= 5 s (run_started, i.e. after interpreter and torch start-up)",
        "met": bool(start) and max(start) <= 5.0,
    }


if __name__ == "__main__":
    raise SystemExit(main())

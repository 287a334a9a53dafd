"""Preemption goodput through the operator: train steps per minute while member pods are lost.

What a user of spot capacity pays for preemptions is the training rate they lose, not any
one recovery timing. So this runs a RolloutRun end to end through ``rolloutrun run``'s
machinery (:class:`~rolloutrun_localcluster.embedded.EmbeddedRun`: local cluster, operator,
trainer and Gym pods) to ``maxSteps`` and measures train steps per minute, all in one
invocation, each number next to its baseline from the same machine and moment:

- **uninterrupted**: no pod deleted (the baseline rate);
- **rollout_snapshots**: the config as shipped (rollout snapshots, forced snapshot on
  SIGTERM), a random member pod (trainer or Gym) deleted every 15, 30 and 60 s of wall
  clock, as spot reclaims come, whatever the run is doing;
- **trainer_checkpoints_only**: the same deletions with rollout recovery switched off
  (``checkpointing.targetLevel: none``, ``rollout.ledgerDispatch: false``, no periodic
  snapshot): every restart resumes from the last trainer checkpoint.

The uninterrupted run trains for ``--window`` seconds (from its trainer's ``run_started``;
default 240 s, four of the longest interval); the steps it reached become ``maxSteps`` of
the preempted runs, so each of them spans several intervals. A preempted run's rate is
``maxSteps`` over the time from its first trainer's ``run_started`` to the last
``step_completed`` of step ``maxSteps`` (``rollout_trace.jsonl``): the first start-up is
outside it, every restart, redone step and backoff inside. A run that does not finish
within ``--run-timeout`` (default: three times the window, at least 120 s) counts the step
it had reached at the timeout. Each
interval's rate is reported per seed (the seed draws the victims) with the mean, spread
(stdev) and worst over seeds, the worst seed named, and as a ratio to the uninterrupted
rate of the same seed. Goal: the
mean ratio with rollout snapshots at a deletion every 30 s is >= 0.75.

Usage: ``python -m bench.preemption_goodput [--quick] [--seeds 1 2 3] [--intervals 15 30 60]
[--config examples/tiny-multiturn.yaml] [--window 240] [--backoff-seconds S] [--out FILE]``;
``--quick`` is one seed and a 90 s window.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun, load_document

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIG = ROOT / "examples" / "tiny-multiturn.yaml"
INTERVALS_S = (15.0, 30.0, 60.0)
#: The goal: rollout snapshots keep this share of the uninterrupted rate at this interval.
GOAL_INTERVAL_S = 30.0
GOAL_RATIO = 0.75
VARIANTS = ("rollout_snapshots", "trainer_checkpoints_only")
TRACE_FILE = "rollout_trace.jsonl"
POLL_S = 0.5
#: A preempted run's default bound: this many times the window.
TIMEOUT_FACTOR = 3.0
MIN_TIMEOUT_S = 120.0
#: The uninterrupted run's bound (only a hang reaches it).
UNBOUNDED_S = 3600.0
#: maxSteps of the uninterrupted run: never reached, it is stopped after its window.
UNREACHED_STEPS = 1_000_000
#: Fewest steps a preempted run trains (a very slow machine still measures something).
MIN_STEPS = 10


def variant_document(
    base: dict[str, Any], variant: str, max_steps: int, backoff_s: int | None
) -> dict[str, Any]:
    """The run of one variant: ``base`` with ``max_steps``; rollout recovery off for
    ``trainer_checkpoints_only`` (no ledger, so no snapshot can be taken, forced or not)."""
    document = copy.deepcopy(base)
    spec = document.setdefault("spec", {})
    run = spec.setdefault("run", {})
    run.setdefault("grpo", {})["maxSteps"] = max_steps
    recovery = spec.setdefault("recovery", {})
    recovery["maxRestarts"] = max(int(recovery.get("maxRestarts") or 0), 1000)
    if backoff_s is not None:
        recovery["backoffSeconds"] = backoff_s
    if variant == "trainer_checkpoints_only":
        checkpointing = run.setdefault("checkpointing", {})
        checkpointing["targetLevel"] = "none"
        checkpointing["snapshotIntervalSeconds"] = 0
        checkpointing["snapshotEverySteps"] = 0
        run.setdefault("rollout", {})["ledgerDispatch"] = False
    return document


def read_trace(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / TRACE_FILE
    events: list[dict[str, Any]] = []
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a deleted trainer
    return events


def steps_per_minute(
    events: list[dict[str, Any]], max_steps: int, reached: int, ended_at: float
) -> dict[str, Any]:
    """Rate from the first ``run_started`` to step ``max_steps`` (or ``reached`` at
    ``ended_at`` for a run that did not finish)."""
    starts = [float(e["t"]) for e in events if e.get("event") == "run_started"]
    finals = [
        float(e["t"])
        for e in events
        if e.get("event") == "step_completed" and int(e.get("step", -1)) == max_steps
    ]
    if not starts:
        return {"steps": 0, "training_s": None, "steps_per_min": 0.0}
    steps, end = (max_steps, max(finals)) if finals else (reached, ended_at)
    span = max(end - min(starts), 1e-9)
    return {"steps": steps, "training_s": round(span, 2), "steps_per_min": 60.0 * steps / span}


def uninterrupted_window(document: dict[str, Any], work: Path, window_s: float) -> dict[str, Any]:
    """The baseline: the run with no deletion, stopped ``window_s`` after its trainer's
    ``run_started``; the steps it trained in that window and their rate."""
    document = copy.deepcopy(document)
    document["spec"]["run"]["grpo"]["maxSteps"] = UNREACHED_STEPS
    cluster_options = {"extra_env": {"PYTHONUNBUFFERED": "1"}}
    deadline = time.monotonic() + UNBOUNDED_S
    with EmbeddedRun(document, work, cluster_options=cluster_options) as run:
        while True:
            starts = [e["t"] for e in read_trace(run.log_dir) if e["event"] == "run_started"]
            if starts and time.time() - float(starts[0]) >= window_s:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the uninterrupted run did not train for {window_s:.0f} s")
            time.sleep(POLL_S)
        ended_at = time.time()
        steps = int((run.last_step() or {}).get("step") or 0)
    span = ended_at - float(starts[0])
    return {"steps": steps, "training_s": round(span, 2), "steps_per_min": 60.0 * steps / span}


def run_once(
    document: dict[str, Any],
    work: Path,
    max_steps: int,
    preempt_every: float | None,
    seed: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One run to ``max_steps`` (or the timeout), its rate, deletions and audit."""
    cluster_options = {"extra_env": {"PYTHONUNBUFFERED": "1"}}
    with EmbeddedRun(document, work, cluster_options=cluster_options) as run:
        result, preempted = run.follow(
            preempt_every=preempt_every,
            timeout=timeout_s,
            rng=random.Random(seed),
            interval=POLL_S,
        )
        ended_at = time.time()
        step = run.last_step() or {}
        summary = run.summary(result, preempted)
    rate = steps_per_minute(
        read_trace(work / "logs"), max_steps, int(step.get("step") or 0), ended_at
    )
    return {
        "result": result,
        **rate,
        "pods_deleted": len(preempted.done),
        "trainers_deleted": sum(1 for _, pod in preempted.done if pod.endswith("-trainer")),
        "incarnations": summary["incarnations"],
        "restarts": summary["restarts"],
        "audit_holds": summary["audit_holds"],
        "thrown_away_s": summary["thrown_away_s"],
        "wall_s": summary["wall_s"],
    }


def aggregate(per_seed: dict[int, dict[str, Any]], baseline: dict[int, float]) -> dict[str, Any]:
    """Mean and worst rate and ratio to the same seed's uninterrupted rate, over seeds."""
    rates = {seed: float(r["steps_per_min"]) for seed, r in per_seed.items()}
    ratios = {seed: rates[seed] / baseline[seed] if baseline[seed] else 0.0 for seed in rates}
    worst = min(ratios, key=lambda seed: ratios[seed])
    return {
        "steps_per_min_mean": round(statistics.fmean(rates.values()), 2),
        "steps_per_min_stdev": round(statistics.stdev(rates.values()), 2)
        if len(rates) > 1
        else 0.0,
        "steps_per_min_worst": round(min(rates.values()), 2),
        "ratio_mean": round(statistics.fmean(ratios.values()), 3),
        "ratio_stdev": round(statistics.stdev(ratios.values()), 3) if len(ratios) > 1 else 0.0,
        "ratio_worst": round(min(ratios.values()), 3),
        "worst_seed": worst,
        "per_seed": {
            str(seed): {
                **r,
                "steps_per_min": round(rates[seed], 2),
                "ratio": round(ratios[seed], 3),
            }
            for seed, r in per_seed.items()
        },
    }


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    base = load_document(args.config)
    runs: dict[str, dict[float, dict[int, dict[str, Any]]]] = {v: {} for v in VARIANTS}
    uninterrupted: dict[int, dict[str, Any]] = {}
    timeout = args.run_timeout or max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * args.window)
    for seed in args.seeds:
        document = variant_document(base, VARIANTS[0], 1, args.backoff_seconds)
        quiet = uninterrupted_window(document, work / f"s{seed}-uninterrupted", args.window)
        uninterrupted[seed] = quiet
        steps = max(MIN_STEPS, quiet["steps"])
        print(f"seed {seed} uninterrupted: {quiet['steps_per_min']:.1f} steps/min", file=sys.stderr)
        for interval in args.intervals:
            for variant in VARIANTS:
                document = variant_document(base, variant, steps, args.backoff_seconds)
                name = f"s{seed}-{variant}-{interval:g}s"
                result = run_once(document, work / name, steps, interval, seed, timeout)
                runs[variant].setdefault(interval, {})[seed] = result
                print(
                    f"seed {seed} {variant} every {interval:g}s: "
                    f"{result['steps_per_min']:.1f} steps/min, {result['pods_deleted']} deleted, "
                    f"{result['result']}",
                    file=sys.stderr,
                )
    baseline = {seed: float(r["steps_per_min"]) for seed, r in uninterrupted.items()}
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count()},
        "config": str(args.config),
        "window_s": args.window,
        "seeds": args.seeds,
        "uninterrupted": {
            "steps_per_min_mean": round(statistics.fmean(baseline.values()), 2),
            "per_seed": {
                str(s): {**r, "steps_per_min": round(baseline[s], 2)}
                for s, r in uninterrupted.items()
            },
        },
    }
    for variant in VARIANTS:
        report[variant] = {
            f"every_{interval:g}s": aggregate(per_seed, baseline)
            for interval, per_seed in runs[variant].items()
        }
    at_goal = report["rollout_snapshots"].get(f"every_{GOAL_INTERVAL_S:g}s")
    report["goal"] = {
        "statement": (
            f">= {GOAL_RATIO:.0%} of the uninterrupted rate with a member pod deleted every "
            f"{GOAL_INTERVAL_S:g} s (rollout snapshots, mean over seeds)"
        ),
        "ratio_mean": None if at_goal is None else at_goal["ratio_mean"],
        "ratio_worst": None if at_goal is None else at_goal["ratio_worst"],
        "worst_seed": None if at_goal is None else at_goal["worst_seed"],
        "met": at_goal is not None and at_goal["ratio_mean"] >= GOAL_RATIO,
    }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a RolloutRun YAML")
    parser.add_argument(
        "--window",
        type=float,
        default=None,
        metavar="SECONDS",
        help="uninterrupted training time; its steps are the preempted runs' maxSteps "
        "(default 240, quick 90)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 1 2 3")
    parser.add_argument(
        "--intervals", type=float, nargs="+", default=list(INTERVALS_S), metavar="SECONDS"
    )
    parser.add_argument(
        "--backoff-seconds", type=int, default=None, help="override recovery.backoffSeconds"
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="seconds per preempted run (default: 3x the window, at least 120)",
    )
    parser.add_argument("--quick", action="store_true", help="one seed, a 90 s window")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    args.window = args.window or (90.0 if args.quick else 240.0)
    args.seeds = args.seeds or ([1] if args.quick else [1, 2, 3])
    with tempfile.TemporaryDirectory(prefix="rolloutrun-goodput-") as tmp:
        report = bench(args, Path(tmp))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Throughput with a snapshot after every step against none: short on/off blocks in one run.

Why blocks inside one run, not pairs of runs: pairs of whole runs (:mod:`bench.rollout_throughput`)
moved by 0.81-1.12 from one repetition to the next on a quiet machine, 20x the effect the
goal (>= 0.995) has to detect: each process brings its own start-up, allocator layout and
Gym/trainer placement on the cores. Here one process trains many steps and switches the
per-step snapshot on and off in short blocks, so both sides share all of that:

- **the schedule**: after ``warmup`` steps (snapshots on: the first snapshot writes the run's
  whole state), blocks of ``block`` steps in the order on, off, off, on, on, off, ... (ABBA:
  a linear drift of the machine's load favours neither side). The step-count interval of the
  trainer checkpoints (``savePeriod``) rotates through the blocks.
- **on**: a snapshot is taken after step k exactly when step k+1 is in an ``on`` block, so
  every ``on`` step carries one snapshot's cost (it runs while the next step trains). A
  trainer checkpoint's snapshot is likewise taken only before an ``on`` step.
- **the guard step**: each block's first step is not measured (a snapshot still running from
  the previous ``on`` block lands there, not on an ``off`` step).
- **paired blocks**: each ``on`` block is paired with its neighbouring ``off`` block (blocks
  0+1, 2+3, ...); the throughput ratio of a pair is off's mean step time over on's, its CPU
  ratio off's CPU per step (trainer process and Gym replicas) over on's.
- **complementary runs**: the bench's config is deterministic, so step k does the same work
  in every run, and that work varies (a step that needs more rollouts takes 1.1 s instead of
  0.7 s, at fixed steps). One schedule alone would put such steps on one side: runs come in
  pairs, the second with every block's side swapped (``phase`` 1), and a pair of runs' block
  pair j counts as one sample, the geometric mean of its two ratios: each step is then
  measured once on and once off, and the step's own cost cancels.
- **the result**: the geometric mean over those samples with a 95 % Student-t interval, and
  the goal stated against it: **met** only if the lower bound reaches it, **missed** if the
  upper bound falls short, **inconclusive** (None) otherwise. With it, how many block pairs
  (and runs) a reading would need to certify the goal at the ratio and spread seen
  (:func:`pairs_to_certify`): at a cost of ~0.25 % and this config's spread, 60-160 block
  pairs, 8-22 runs (up to ~30 min on 2 cores); the default 2 runs (16 block pairs) are
  inconclusive by construction. ``between_pairs_of_runs`` says
  whether that pooling is sound (:func:`between_pairs_of_runs`): whole runs that differ by more
  than their blocks predict would make the pooled interval too narrow.
- **gating**: the bench wraps the runtime's "snapshot after this step?" decision and its
  "a trainer checkpoint was published" wake-up in the trainer's process (both trees have
  them), so the same code measures another checkout side by side (``baseline``).

``python -m bench.throughput_blocks --one CONFIG LOGDIR WARMUP BLOCK PHASE`` is one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.tree_run import run_in_tree

#: The goal: steps/s with a snapshot after every step over steps/s without snapshots.
GOAL_RATIO = 0.995
WARMUP = 6
BLOCK = 4
CYCLES = 8  # each cycle is on, off, off, on: two pairs
_ABBA = ("on", "off", "off", "on")
#: Student t, two-sided 95 %: df -> quantile (beyond 30 the normal's 1.96 is close enough).
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
    17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 22: 2.074, 24: 2.064, 26: 2.056, 28: 2.048,
    30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip


def side_of(step: int, warmup: int, block: int, phase: int = 0) -> tuple[str, int]:
    """The side step ``step`` (1-based) trains under and its block (-1: warm-up, on);
    ``phase`` 1 is the complementary schedule (every block's side swapped)."""
    if step <= warmup:
        return "on", -1
    index = (step - warmup - 1) // block
    side = _ABBA[index % 4]
    if phase % 2:
        side = "off" if side == "on" else "on"
    return side, index


def total_steps(warmup: int, block: int, cycles: int) -> int:
    return warmup + 4 * block * cycles


def t975(df: int) -> float:
    """The 97.5 % Student-t quantile, rounded up to the nearest tabulated df below."""
    if df < 1:
        raise ValueError("an interval needs at least two pairs")
    return _T975[max(k for k in _T975 if k <= df)] if df <= 120 else 1.96


def _log_mean_sd(ratios: list[float]) -> tuple[float, float]:
    """The mean and standard deviation of the ratios' logs (at least two ratios)."""
    logs = [math.log(r) for r in ratios]
    return statistics.fmean(logs), statistics.stdev(logs)


def interval(ratios: list[float]) -> dict[str, float]:
    """Geometric mean of ``ratios`` with its 95 % t interval (over the logs)."""
    t = t975(len(ratios) - 1)  # fewer than two pairs: no interval
    mean, sd = _log_mean_sd(ratios)
    half = t * sd / math.sqrt(len(ratios))
    return {
        "mean": round(math.exp(mean), 4),
        "low": round(math.exp(mean - half), 4),
        "high": round(math.exp(mean + half), 4),
        "n": len(ratios),
    }


def pairs_to_certify(ratios: list[float], goal: float = GOAL_RATIO) -> int | None:
    """Block pairs a reading needs for its interval's low end to reach ``goal``, if the
    ratios went on as these did (their mean and spread, the normal's 1.96 for the t
    quantile); None when their mean does not exceed ``goal`` (no number of pairs would).

    Why: the interval narrows as one over the square root of the pairs, and the effect to
    tell from the goal is a few tenths of a percent; a short reading is inconclusive by
    construction, and this says how long a run would decide it."""
    if len(ratios) < 2:
        return None
    mean, sd = _log_mean_sd(ratios)
    margin = mean - math.log(goal)
    return None if margin <= 0 else max(2, math.ceil((1.96 * sd / margin) ** 2))


def verdict(ci: dict[str, float], goal: float = GOAL_RATIO) -> bool | None:
    """Met when the interval's lower bound reaches ``goal``, missed when its upper bound
    falls short, None (inconclusive) when the interval holds it."""
    if ci["low"] >= goal:
        return True
    if ci["high"] < goal:
        return False
    return None


def blocks(
    samples: list[dict[str, float]], warmup: int, block: int, phase: int = 0
) -> list[dict[str, Any]]:
    """Per complete block after warm-up: its side and, over its steps after the guard step,
    the mean wall seconds and CPU ms (trainer + Gym) per step. ``samples[i]`` is taken at the
    end of step i+1 (``t``, ``cpu`` and ``gym_cpu`` cumulative)."""
    out: list[dict[str, Any]] = []
    count = (len(samples) - warmup) // block
    for index in range(count):
        first = warmup + index * block + 1  # the guard step
        start, end = samples[first - 1], samples[first + block - 2]  # ends of guard and last
        steps = block - 1
        out.append(
            {
                "side": side_of(first, warmup, block, phase)[0],
                "step_s": (end["t"] - start["t"]) / steps,
                "cpu_ms": (end["cpu"] - start["cpu"] + end["gym_cpu"] - start["gym_cpu"])
                * 1000
                / steps,
                "gym_cpu_ms": (end["gym_cpu"] - start["gym_cpu"]) * 1000 / steps,
                **_share_ms(start, end, steps),
            }
        )
    return out


def _share_ms(start: dict[str, Any], end: dict[str, Any], steps: int) -> dict[str, float]:
    """CPU ms per step by where it ran: ``cpu_ms:<thread kind>`` of the trainer process,
    ``cpu_ms:gym``, ``cpu_ms:writer child`` (samples without the split give nothing)."""
    if "threads" not in end:
        return {}
    kinds = set(start["threads"]) | set(end["threads"])
    out = {
        f"cpu_ms:{kind}": (end["threads"].get(kind, 0.0) - start["threads"].get(kind, 0.0))
        * 1000
        / steps
        for kind in kinds
    }
    out["cpu_ms:gym"] = (end["gym_cpu"] - start["gym_cpu"]) * 1000 / steps
    out["cpu_ms:writer child"] = (end["child_cpu"] - start["child_cpu"]) * 1000 / steps
    return out


def pairs(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Blocks 0+1, 2+3, ...: one on and one off each; off over on for time and CPU."""
    out = []
    for a, b in zip(rows[0::2], rows[1::2], strict=False):
        on, off = (a, b) if a["side"] == "on" else (b, a)
        if {on["side"], off["side"]} != {"on", "off"}:
            raise ValueError(f"blocks {a['side']}/{b['side']} are not an on/off pair")
        out.append(
            {
                "ratio": off["step_s"] / on["step_s"],
                "cpu_ratio": off["cpu_ms"] / on["cpu_ms"],
                "snapshot_cpu_ms": on["cpu_ms"] - off["cpu_ms"],
                "gym_snapshot_cpu_ms": on["gym_cpu_ms"] - off["gym_cpu_ms"],
                "on_step_s": on["step_s"],
                "off_step_s": off["step_s"],
                **{
                    key: on.get(key, 0.0) - off.get(key, 0.0)
                    for key in sorted(set(on) | set(off))
                    if key.startswith("cpu_ms:")
                },
            }
        )
    return out


def complementary(
    first: list[dict[str, float]], second: list[dict[str, float]]
) -> list[dict[str, float]]:
    """Block pair j of a run and of its complementary run as one sample: the geometric mean
    of their ratios (each step measured once on and once off), the mean of the rest."""
    if len(first) != len(second):
        raise ValueError(f"complementary runs differ in block pairs: {len(first)} != {len(second)}")
    out = []
    for a, b in zip(first, second, strict=True):
        row = {key: (a.get(key, 0.0) + b.get(key, 0.0)) / 2 for key in a.keys() | b.keys()}
        row["ratio"] = math.sqrt(a["ratio"] * b["ratio"])
        row["cpu_ratio"] = math.sqrt(a["cpu_ratio"] * b["cpu_ratio"])
        out.append(row)
    return out


def by_pair_of_runs(results: list[dict[str, Any]]) -> list[list[dict[str, float]]]:
    """Runs in complementary pairs (phase 0, then 1) as each pair's samples."""
    phases = zip(results[::2], results[1::2], strict=True)
    return [complementary(a["pairs"], b["pairs"]) for a, b in phases]


def summarize(all_pairs: list[dict[str, float]]) -> dict[str, Any]:
    ratio = interval([p["ratio"] for p in all_pairs])
    cpu = [p["snapshot_cpu_ms"] for p in all_pairs]
    return {
        "ratio": ratio,
        "cpu_ratio": interval([p["cpu_ratio"] for p in all_pairs]),
        "snapshot_cpu_ms_per_step": round(statistics.fmean(cpu), 2),
        "gym_snapshot_cpu_ms_per_step": round(
            statistics.fmean(p["gym_snapshot_cpu_ms"] for p in all_pairs), 2
        ),
        # Where the snapshot's CPU ran (on minus off, ms per step): the trainer's threads,
        # its Gym replicas, its writer child (which the CPU ratio above does not count).
        "snapshot_cpu_ms_by_place": {
            key.removeprefix("cpu_ms:"): round(
                statistics.fmean(p.get(key, 0.0) for p in all_pairs), 2
            )
            for key in sorted({k for p in all_pairs for k in p if k.startswith("cpu_ms:")})
        },
        "on_step_s_median": round(statistics.median(p["on_step_s"] for p in all_pairs), 4),
        "off_step_s_median": round(statistics.median(p["off_step_s"] for p in all_pairs), 4),
        "goal": f"ratio >= {GOAL_RATIO}: met if the 95 % interval's low end reaches it, missed "
        "if its high end falls short, null (inconclusive) otherwise",
        "met": verdict(ratio),
        "block_pairs_to_certify": pairs_to_certify([p["ratio"] for p in all_pairs]),
    }


#: Between-run spread this many times what the runs' own block spread predicts: the runs
#: differ (placement, a neighbour's load), and the pooled interval would be too narrow.
RUNS_DIFFER_AT = 1.5


def between_pairs_of_runs(samples: list[list[dict[str, float]]]) -> dict[str, Any] | None:
    """Whether pooling every pair of runs' block pairs is sound: the spread of the
    per-pair-of-runs mean log ratios against the spread their own block pairs predict.

    Why: the pooled interval treats every block pair as independent. If whole runs differ
    (a run whose threads landed badly costs more for all its snapshots), block pairs of one
    run are alike and the pooled interval is too narrow; the interval over the pairs' means
    (``over_pairs``, few samples, wide) is then the one to believe. None below two pairs."""
    if len(samples) < 2 or any(len(pair) < 2 for pair in samples):
        return None
    logs = [[math.log(p["ratio"]) for p in pair] for pair in samples]
    means = [statistics.fmean(pair) for pair in logs]
    within = statistics.fmean(statistics.variance(pair) / len(pair) for pair in logs)
    observed = statistics.stdev(means)
    expected = math.sqrt(within)
    # Rounded before the flag, so the flag agrees with the figure printed beside it; None
    # (JSON has no infinity) when the blocks predict no spread at all.
    ratio = round(observed / expected, 2) if expected > 0 else None
    return {
        "pairs_of_runs": len(samples),
        "sd_of_pair_means": round(observed, 5),
        "sd_expected_from_blocks": round(expected, 5),
        "spread_ratio": ratio,
        "runs_differ": observed > 0 if ratio is None else ratio >= RUNS_DIFFER_AT,
        "over_pairs": interval([math.exp(m) for m in means]),
    }


def install_gate(warmup: int, block: int, phase: int = 0) -> None:
    """In this (the trainer's) process: snapshots after step k only when step k+1 is ``on``."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing import snapshots

    decide = snapshots.should_snapshot_after_step
    published = snapshots.RolloutSnapshotter.trainer_checkpoint_published

    def gated(step: int, every_steps: int) -> bool:
        return side_of(step + 1, warmup, block, phase)[0] == "on" and decide(step, every_steps)

    def gated_published(self: Any, step: int) -> None:
        if side_of(step + 1, warmup, block, phase)[0] == "on":
            published(self, step)

    snapshots.should_snapshot_after_step = gated  # type: ignore[assignment]
    snapshots.RolloutSnapshotter.trainer_checkpoint_published = gated_published  # type: ignore[method-assign]


def _published(log_dir: Path) -> int:
    path = log_dir / "snapshots.jsonl"
    if not path.exists():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(
        1 for r in lines if str(r.get("rollout/checkpoint_outcome", "")).startswith("published")
    )


def write_config(base: dict[str, Any], path: Path, steps: int) -> Path:
    """``base`` with a snapshot after every step, no timer, ``steps`` train steps."""
    data = json.loads(json.dumps(base))
    data["grpo"]["maxSteps"] = steps
    data["checkpointing"].update(
        {"snapshotEverySteps": 1, "snapshotIntervalSeconds": 0, "snapshotEveryRollouts": 0}
    )
    path.write_text(yaml.safe_dump(data))
    return path


def _one_subprocess(
    tree: Path, config: Path, log_dir: Path, warmup: int, block: int, phase: int
) -> dict:
    argv = ["--one", str(config), str(log_dir), str(warmup), str(block), str(phase)]
    return dict(run_in_tree(tree, "bench.throughput_blocks", argv, 1800))


def schedule(pairs_per_tree: dict[str, int]) -> list[tuple[str, int]]:
    """The order of the runs: ``(tree, pair of runs)`` per complementary pair, each tree's
    pairs spread evenly over the whole measurement (a tree with fewer pairs, such as a
    baseline whose verdict needs fewer samples, still meets every stretch of the machine's
    load), trees that fall due together in the order given, alternated from one such
    meeting to the next."""
    due: list[tuple[float, int, str, int]] = []
    for rank, (tree, count) in enumerate(pairs_per_tree.items()):
        due.extend(((index + 0.5) / count, rank, tree, index) for index in range(count))
    due.sort()
    out: list[tuple[str, int]] = []
    flip = False
    for _, group in itertools.groupby(due, key=lambda d: d[0]):
        members = [(tree, index) for _, _, tree, index in group]
        out.extend(reversed(members) if flip and len(members) > 1 else members)
        flip ^= len(members) > 1
    return out


def measure(
    base: dict[str, Any],
    root: Path,
    *,
    baseline: str | None = None,
    runs: int = 2,
    baseline_runs: int | None = None,
    cycles: int = CYCLES,
    warmup: int = WARMUP,
    block: int = BLOCK,
) -> dict[str, Any]:
    """``runs`` runs (rounded up to complementary pairs) of this tree and, with
    ``baseline``, ``baseline_runs`` (default ``runs``) of that checkout, the trees' pairs
    of runs interleaved by :func:`schedule`; per tree the samples of every pair of
    complementary runs pooled."""
    here = Path(__file__).resolve().parent.parent
    trees = {"this_tree": here}
    pairs_per_tree = {"this_tree": (runs + 1) // 2}
    if baseline:
        trees = {"baseline": Path(baseline).resolve(), **trees}
        pairs_per_tree = {"baseline": ((baseline_runs or runs) + 1) // 2, **pairs_per_tree}
    steps = total_steps(warmup, block, cycles)
    config = write_config(base, root / "tput-blocks.yaml", steps)
    got: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    load = [round(os.getloadavg()[0], 2)]
    order = schedule(pairs_per_tree)
    for done, (tree, index) in enumerate(order, 1):
        started = time.monotonic()
        for phase in (0, 1):
            log_dir = root / f"tput-blocks-{tree}-{2 * index + phase}"
            one = _one_subprocess(trees[tree], config, log_dir, warmup, block, phase)
            got[tree].append(one)
            load.append(round(os.getloadavg()[0], 2))
        samples = by_pair_of_runs(got[tree])
        so_far = interval([p["ratio"] for pair_of_runs in samples for p in pair_of_runs])
        last = interval([p["ratio"] for p in samples[-1]])["mean"]
        print(
            f"throughput pair of runs {done}/{len(order)} ({tree} #{index}, "
            f"{time.monotonic() - started:.0f} s): ratio {last}; "
            f"{tree} so far {so_far['mean']} [{so_far['low']}, {so_far['high']}] "
            f"over {so_far['n']} block pairs; load {load[-1]}",
            file=sys.stderr,
            flush=True,
        )
    out: dict[str, Any] = {
        "method": "on/off blocks inside each run (bench.throughput_blocks)",
        "steps_per_run": steps,
        "warmup_steps": warmup,
        "block_steps": block,
        "runs_per_tree": {tree: 2 * count for tree, count in pairs_per_tree.items()},
        "load_1m": load,
        "cpus": os.cpu_count(),
    }
    for tree, results in got.items():
        samples = by_pair_of_runs(results)
        pooled = summarize([s for pair_of_runs in samples for s in pair_of_runs])
        # what --throughput-repetitions would have to be for that many block pairs
        needed, per_pair_of_runs = pooled["block_pairs_to_certify"], len(samples[0])
        runs_needed = None if needed is None else 2 * math.ceil(needed / per_pair_of_runs)
        out[tree] = {
            "tree": str(trees[tree]),
            **pooled,
            "runs_to_certify": runs_needed,
            "between_pairs_of_runs": between_pairs_of_runs(samples),
            "per_pair_of_runs": [summarize(s) for s in samples],
            "per_run": [
                {"phase": i % 2, "published": r["published"], **summarize(r["pairs"])}
                for i, r in enumerate(results)
            ],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=5, metavar=("CONFIG", "LOGDIR", "WARMUP", "BLOCK", "PHASE"))
    args = parser.parse_args(argv)
    if not args.one:
        parser.error(
            "--one CONFIG LOGDIR WARMUP BLOCK PHASE (the throughput part of "
            "bench.rollout_checkpoint runs the blocks)"
        )
    from bench.rollout_throughput import run_one

    config, log_dir = Path(args.one[0]), Path(args.one[1])
    warmup, block, phase = (int(x) for x in args.one[2:])
    install_gate(warmup, block, phase)
    samples = run_one(config, log_dir)["samples"]
    rows = blocks(samples, warmup, block, phase)
    print(json.dumps({"pairs": pairs(rows), "published": _published(log_dir), "blocks": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Throughput with a snapshot after every step against none, measured so it can be believed.

Why its own module: one pair of whole runs per side (``rollout_checkpoint``'s old
``throughput`` part) measured the goal (>= 0.995) with a noise of a few per cent on a shared
machine, so the figure moved between 0.975 and 0.988 from run to run. Here:

- **interleaved repetitions**: pairs of runs, "snapshot after every step" (``on``) and "no
  snapshots" (``off``), the same config and seed, each a fresh process; the order inside a
  pair alternates (on/off, off/on, ...) so a drift of the machine's load favours neither.
  Every repetition is reported, with the median ratio and its spread (min, max, quartiles).
- **the same steps after warm-up**: each run reports per train step (an ``on_step`` hook of
  its own, not ``metrics.jsonl``) its wall clock and CPU time; steps/s and CPU per step are
  counted over the steps after ``warmup`` (interpreter, torch and the first steps' allocator
  growth excluded), the same number on both sides. ``median_step_ratio`` (off over on median
  step time) is the same comparison less moved by a load spike on a few steps.
- **CPU time per train step**: the trainer process's CPU time (all its threads: trainer,
  in-process generation, the snapshot writer) and its Gym replica's (the environment phase
  of a snapshot runs there), which other load on the machine inflates much less than the
  wall clock.
- **trees side by side** (``baseline``): the same repetitions with another checkout's
  runtime, its runs interleaved with this tree's, so both ratios come from one invocation.

The throughput part of ``bench.rollout_checkpoint`` now measures on/off blocks inside each
run (:mod:`bench.throughput_blocks`, whose runs are this module's :func:`run_one`): whole-run
pairs still moved 0.81-1.12 between repetitions on a quiet machine.

``python -m bench.rollout_throughput --one CONFIG LOGDIR`` is one run (the trees' runs are
such subprocesses, each with its tree's runtime first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

#: The goal: steps/s with a snapshot after every step over steps/s without snapshots.
GOAL_RATIO = 0.995
STEPS = 24
WARMUP = 4
REPETITIONS = 5
SIDES = {
    # A snapshot after every step (and every second, as the issue's figure was measured).
    "on": {"snapshotEverySteps": 1, "snapshotIntervalSeconds": 1},
    "off": {"snapshotEverySteps": 0, "snapshotIntervalSeconds": 0},
}
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (``/proc/PID/stat``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def thread_cpu_s() -> dict[str, float]:
    """This process's CPU seconds per kind of thread (the Python name less its number:
    ``MainThread``, ``asyncio``, ``generation``; unnamed native threads by ``comm``)."""
    import re
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path(f"/proc/self/task/{tid}")
        try:
            name = names.get(int(tid)) or (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        kind = re.sub(r"[-_ ]*\d+(_\d+)*$", "", name) or name
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def children_cpu_s(skip: set[int]) -> float:
    """CPU seconds of this process's live children but ``skip`` (the snapshot writer)."""
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            pids = Path(f"/proc/self/task/{tid}/children").read_text().split()
        except OSError:
            continue
        total += sum(_process_cpu_s(int(pid)) for pid in pids if int(pid) not in skip)
    return total


def run_one(config_file: Path, log_dir: Path) -> dict[str, Any]:
    """One local run (its Gym replicas, the trainer in this process) with a per-step sample
    of wall clock, this process's CPU time (also per kind of thread), its Gym replicas' CPU
    time and its other children's (the snapshot writer process)."""
    import asyncio
    import secrets

    from rolloutrun_runtime.algorithms.single_controller.hooks import OnStep
    from rolloutrun_runtime.contract.run_config import load_run_config
    from rolloutrun_runtime.launcher import start_gym, stop_process
    from rolloutrun_runtime.trainer import run_trainer

    cfg = load_run_config(config_file).model_copy(update={"log_dir": str(log_dir)})
    if log_dir.exists() and any(log_dir.iterdir()):
        raise SystemExit(f"{log_dir} is not empty: a run there would resume, not train")
    log_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    gyms = [start_gym(config_file, log_dir, i, token) for i in range(cfg.gym.replicas)]
    samples: list[dict[str, float]] = []

    def on_step(record: dict[str, Any]) -> None:
        times = os.times()
        samples.append(
            {
                "t": time.perf_counter(),
                "cpu": times.user + times.system,
                "cpu_sys": times.system,
                "gym_cpu": sum(_process_cpu_s(g.process.pid) for g in gyms),
                "tokens": record["generated_tokens"],
                "threads": thread_cpu_s(),
                "child_cpu": children_cpu_s({g.process.pid for g in gyms}),
            }
        )

    try:
        gym = cfg.gym.model_copy(update={"endpoints": [g.url for g in gyms]})
        cfg = cfg.model_copy(update={"gym": gym})
        asyncio.run(run_trainer(cfg, hooks=OnStep(on_step), gym_token=token))
    finally:
        for g in gyms:
            stop_process(g.process)
            g.log.close()
    return {"samples": samples}


def window(samples: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Steps/s, CPU ms per step (trainer, Gym) and tokens/s over the steps after ``warmup``:
    from the end of step ``warmup`` to the end of the last step."""
    if warmup < 1 or len(samples) <= warmup:
        raise ValueError(
            f"{len(samples)} steps recorded, warm-up {warmup}: need 1 <= warm-up < steps"
        )
    start, last = samples[warmup - 1], samples[-1]
    steps = len(samples) - warmup
    wall = last["t"] - start["t"]
    tokens = sum(s["tokens"] for s in samples[warmup:])
    times = [b["t"] - a["t"] for a, b in zip(samples[warmup - 1 :], samples[warmup:], strict=False)]
    return {
        "steps": steps,
        "steps_per_s": round(steps / wall, 4),
        "median_step_s": round(statistics.median(times), 4),
        "tokens_per_s": round(tokens / wall, 1),
        "cpu_ms_per_step": round((last["cpu"] - start["cpu"]) * 1000 / steps, 2),
        "cpu_sys_ms_per_step": round((last["cpu_sys"] - start["cpu_sys"]) * 1000 / steps, 2),
        "gym_cpu_ms_per_step": round((last["gym_cpu"] - start["gym_cpu"]) * 1000 / steps, 2),
    }


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (the spread the median came from)."""
    ordered = sorted(values)
    if len(ordered) < 2:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {
        "median": round(statistics.median(ordered), 4),
        "min": round(ordered[0], 4),
        "max": round(ordered[-1], 4),
        "q1": round(q1, 4),
        "q3": round(q3, 4),
        "n": len(ordered),
    }


def summarize(repetitions: list[dict[str, Any]]) -> dict[str, Any]:
    """Per tree over its repetitions: the throughput ratio (on / off steps/s) and the CPU
    ratio (off / on CPU per step, trainer + Gym: 1.0 = snapshots cost no CPU)."""
    ratios = [r["ratio"] for r in repetitions]
    cpu = [r["cpu_ratio"] for r in repetitions]
    out = {
        "ratio": spread(ratios),
        "cpu_ratio": spread(cpu),
        "median_step_ratio": spread([r["median_step_ratio"] for r in repetitions]),
        "cpu_ms_per_step": {side: spread([_cpu(r[side]) for r in repetitions]) for side in SIDES},
        "snapshot_cpu_ms_per_step": spread([_cpu(r["on"]) - _cpu(r["off"]) for r in repetitions]),
        "goal": f"ratio >= {GOAL_RATIO} (met: at the lower quartile; null: spread straddles it)",
    }
    out["met"] = verdict(out["ratio"])
    return out


def verdict(ratio: dict[str, float]) -> bool | None:
    """Met when even the lower quartile reaches the goal, missed when even the upper quartile
    falls short; None when the spread straddles it (the machine was too noisy to decide)."""
    if ratio["q1"] >= GOAL_RATIO:
        return True
    if ratio["q3"] < GOAL_RATIO:
        return False
    return None


def _cpu(side: dict[str, float]) -> float:
    """CPU ms per train step, the trainer's and its Gym replicas'."""
    return side["cpu_ms_per_step"] + side["gym_cpu_ms_per_step"]


def pair(on: dict[str, float], off: dict[str, float], order: list[str]) -> dict[str, Any]:
    return {
        "order": order,
        "on": on,
        "off": off,
        "ratio": round(on["steps_per_s"] / off["steps_per_s"], 4),
        "median_step_ratio": round(off["median_step_s"] / on["median_step_s"], 4),
        "cpu_ratio": round(_cpu(off) / _cpu(on), 4),
    }


def _write_config(base: dict[str, Any], path: Path, side: str, steps: int) -> Path:
    data = json.loads(json.dumps(base))
    data["grpo"]["maxSteps"] = steps
    data["checkpointing"].update(SIDES[side])
    path.write_text(yaml.safe_dump(data))
    return path


def _one_subprocess(tree: Path, config: Path, log_dir: Path, warmup: int) -> dict[str, float]:
    here = Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(here), str(tree / "runtime"), str(tree / "operator")])
    done = subprocess.run(
        [sys.executable, "-m", "bench.rollout_throughput", "--one", str(config), str(log_dir)],
        env={**os.environ, "PYTHONPATH": path},
        cwd=here,
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return window(json.loads(done.stdout.splitlines()[-1])["samples"], warmup)


def interleaved(
    base: dict[str, Any],
    root: Path,
    *,
    baseline: str | None = None,
    repetitions: int = REPETITIONS,
    steps: int = STEPS,
    warmup: int = WARMUP,
) -> dict[str, Any]:
    """``repetitions`` rounds; each runs on and off for every tree (this tree and, with
    ``baseline``, that checkout), the order rotating from round to round."""
    here = Path(__file__).resolve().parent.parent
    trees = {"this_tree": here}
    if baseline:
        trees = {"baseline": Path(baseline).resolve(), **trees}
    configs = {side: _write_config(base, root / f"tput-{side}.yaml", side, steps) for side in SIDES}
    runs = [(tree, side) for tree in trees for side in SIDES]
    reps: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    load = [round(os.getloadavg()[0], 2)]
    for rep in range(repetitions):
        shift = rep // 2 % len(runs)  # on/off, off/on, then the same from the next run
        order = runs[shift:] + runs[:shift]
        if rep % 2:
            order.reverse()
        got: dict[tuple[str, str], dict[str, float]] = {}
        for tree, side in order:
            log_dir = root / f"tput-{tree}-{side}-{rep}"
            got[tree, side] = _one_subprocess(trees[tree], configs[side], log_dir, warmup)
        for tree in trees:
            sides = [side for t, side in order if t == tree]
            reps[tree].append(pair(got[tree, "on"], got[tree, "off"], sides))
        load.append(round(os.getloadavg()[0], 2))
    out: dict[str, Any] = {
        "steps": steps,
        "warmup_steps": warmup,
        "repetitions": repetitions,
        "sides": SIDES,
        "load_1m_per_round": load,
        "cpus": os.cpu_count(),
    }
    for tree, path in trees.items():
        out[tree] = {"tree": str(path), "per_repetition": reps[tree], **summarize(reps[tree])}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "LOGDIR"), required=True)
    args = parser.parse_args(argv)
    result = run_one(Path(args.one[0]), Path(args.one[1]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Elastic members benchmark on the local cluster, printed as JSON.

Arms of the same run (the real trainer and Gym pods), one after the other in this one
process, each trained for the same window of wall clock, repeated over ``--seeds`` seeds
(the run's seed, and which Gym is deleted first):

- ``undisturbed``: nothing deleted (the rate to compare with).
- ``elastic``: a Gym pod deleted every ``--every`` seconds; the operator replaces it while
  the trainer goes on (``recovery.elasticMembers: true``, the default).
- ``elastic_before`` (with ``--before REF``): the same, its pods running the runtime of git
  ``REF`` or of the checkout directory ``REF`` (a copy of its ``runtime/`` on their
  ``PYTHONPATH``; the operator is this tree's): the before/after of the replacement path,
  side by side in one run (with ``--paired``, at the same time as the other two).
- ``ending`` (first seed, not with ``--quick``): the same deletions with
  ``recovery.elasticMembers: false``: each lost Gym ends the incarnation (the behaviour
  before elastic members).

Per arm: train steps per minute over the window (highest step reached, so steps trained
again after a restart are not counted twice), incarnations, and per deletion the recovery
time: elastic, from the deletion until the replacement's first ``/run`` (its Gym's log),
with the stages of that path (:data:`STAGES`: the API's watch events on this process's
clock, then the pods' log lines; the replacement Gym's start-up CPU and its seconds since
its process started, from its own log), and until the operator saw it Ready
(``status.memberReplacements``); ending, from the deletion until the next incarnation
trained its first step. Every deletion is reported (``per_deletion``,
:func:`.elastic_report.deletion_report`: the stage it reached and its outcome), none dropped
for being incomplete; one whose replacement did no work within 5 s fails the time goal.
``--level turn``: a multi-turn task with turn-level snapshots. Over the seeds: mean, spread
and the worst seed, each stage's p50 and max over every deletion of every seed, and the
goals (issue 14) checked against the worst seed: elastic >= 90 % of the undisturbed rate;
loss -> replacement doing work <= 5 s.

``--interleaved`` (the rate's measurement): per seed ONE elastic run whose window alternates
segments of ``2 * --every`` seconds, undisturbed and disturbed (a Gym deleted at the start
and the middle of the segment: the same one deletion per ``--every`` seconds), ``--pairs``
pairs in ABBA order (U D, D U, U D, ...), so both arms share the run, its warm-up and the
machine's load at the same minutes; the seed's ratio is the disturbed segments' rate over
the undisturbed ones', and the per-pair ratios give its spread. Separate runs back to back
(the default) swung +-0.14 between two arms of the same runtime on a shared machine. An
even ``--pairs`` balances a linear drift; the run's own is not linear (as the policy learns,
more groups with one reward for all siblings are dropped: a step takes ~2x longer at step
150 than at step 20). ``--role worker``: worker pods (:mod:`.elastic_workers_interleaved`).

``--paired`` (the rate's measurement, preferred): per seed the undisturbed and the elastic
arm run AT THE SAME TIME, each in its own process and local cluster, their windows started
together once both train: the same machine load at the same moments and the same run age.
The replacements' start-up CPU is taken from both arms alike (one shared machine). Where
the rate goes: each elastic arm's ``steps_around_deletions``, ``rollouts_around_deletions``
(rollouts finished, groups dropped) and ``cpu_around_deletions`` (its trainer's and Gyms'
CPU), each against the undisturbed arm's at the same moments (:mod:`.elastic_report`).

This tree's pods run a byte-compiled copy of its ``runtime/`` (as an installed image is;
the pods' root is read-only, so a tree without ``__pycache__`` compiled every module at each
pod start, ~12 % of a Gym's start-up CPU, which ``--before``'s copy never paid).

Usage: ``python -m bench.elastic [--window 90] [--every 15] [--seeds 3] [--quick]
[--before REF] [--paired | --interleaved [--pairs 4]]``. The machine may be shared: by
default the arms run in one process, back to back, so they share its load.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements

from .elastic_report import (
    OUTCOMES,
    STAGES,
    ReplacementWatch,
    _breakdown_stats,
    _gym_start,
    _marker_times,
    _stats,
    abba_pairs,
    arm_standby_work,
    cpu_around_deletions,
    delete_watched,
    deletion_report,
    interleaved_rates,
    over_seeds,
    pod_cpu_rows,
    rollouts_around_deletions,
    steps_around_deletions,
    trace_times,
    trainer_step_times,
)
from .elastic_report import _spread as _spread  # bench.elastic_workers takes it from here
from .operator_recovery import LONG_RUN, wait
from .pod_cpu import PodCpuSampler
from .runtime_copies import pods_pythonpath as _pods_pythonpath
from .runtime_copies import runtime_at as runtime_at
from .runtime_copies import runtime_here as runtime_here

#: ``--level turn``: the run as a multi-turn task with turn-level snapshots (side effects per
#: turn; a lost Gym's episodes resume from their records), as the turn-level e2e runs it.
TURN_LEVEL: dict[str, Any] = {
    "task": {"name": "reach_target", "datasetSize": 512, "maxOperand": 9, "maxTurns": 3,
             "maxNewTokens": 3},
    "maxSeqLen": 48,
}  # fmt: skip


def _document(
    elastic: bool, seed: int = 0, level: str = "sibling", gym_standby: int = 0
) -> dict[str, Any]:
    document = copy.deepcopy(LONG_RUN)
    document["spec"]["recovery"]["elasticMembers"] = elastic
    document["spec"]["gym"]["standby"] = gym_standby  # gym-2.. (never deleted: k % 2)
    run = document["spec"]["run"]
    run["seed"] += seed
    if level == "turn":
        run["task"] = dict(TURN_LEVEL["task"])
        run["policy"]["maxSeqLen"] = TURN_LEVEL["maxSeqLen"]
        run["checkpointing"]["targetLevel"] = "turn"
    return document


def _highest_step(run: EmbeddedRun) -> int:
    metrics = run.log_dir / "metrics.jsonl"
    steps = [0]
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                continue
    return max(steps)


def _log_times(run: EmbeddedRun, marker: str) -> list[float]:
    """Epoch times of the trainer log lines (every incarnation) holding ``marker``."""
    times = []
    for log in sorted((run.work_dir / "cluster").glob("pods/*/*-trainer-*/logs/trainer.log")):
        for line in log.read_text(errors="replace").splitlines():
            if marker in line:
                stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                times.append(stamp.timestamp())
    return sorted(times)


def _first_step_after(run: EmbeddedRun, since: float, incarnation: int) -> float | None:
    """Epoch time the trainer of ``incarnation`` (or later) first trained, after ``since``."""
    while True:
        if int(run.status().get("incarnation") or 0) >= incarnation:
            lease = run.lease()
            holder = (lease.spec.holder_identity or "") if lease is not None else ""
            notes = (lease.metadata.annotations or {}) if lease is not None else {}
            n = holder.rsplit("/", 1)[-1]
            if n.isdigit() and int(n) >= incarnation and notes.get("rolloutrun.dev/train-step"):
                return time.time()
        if time.time() - since > 180:
            return None
        time.sleep(0.05)


@dataclasses.dataclass
class Arm:
    """What one arm runs: its name, elastic or not, whether Gyms are deleted, the seed
    (the run's, and the first Gym deleted) and the runtime tree its pods import (None:
    this process's ``PYTHONPATH``)."""

    name: str
    elastic: bool
    delete: bool
    seed: int = 0
    runtime: Path | None = None
    gym_standby: int = 0


def arm(
    spec: Arm, work: Path, *, window: float, every: float, level: str = "sibling"
) -> dict[str, Any]:
    """One arm: start, wait for training, run ``window`` seconds deleting Gym pods."""
    saved = os.environ.get("PYTHONPATH")
    os.environ.update(_pods_pythonpath(spec.runtime))
    try:
        document = _document(spec.elastic, spec.seed, level, spec.gym_standby)
        with EmbeddedRun(document, work / spec.name) as run:
            wait(lambda: _highest_step(run) >= 2, f"{spec.name}: training", bound=600)
            return _window(run, spec, window, every)
    finally:
        os.environ.pop("PYTHONPATH", None)
        if saved is not None:
            os.environ["PYTHONPATH"] = saved


def _window(
    run: EmbeddedRun,
    spec: Arm,
    window: float,
    every: float,
    *,
    role: str = "gym",
    members: int = 2,
    replacements: Callable[..., dict[str, Any]] | None = None,
    pick: Callable[[EmbeddedRun, int, int], str] | None = None,
) -> dict[str, Any]:
    """Train ``window`` seconds, deleting a ``role`` pod (of ``members``) every ``every``
    seconds (with ``spec.delete``); ``replacements`` reads an elastic arm's recoveries;
    ``pick(run, incarnation, k)`` names the k-th pod deleted (default: round robin)."""

    def victim_of(run: EmbeddedRun, n: int, k: int) -> str:
        return pick(run, n, k) if pick else f"bench-i{n}-{role}-{k % members}"

    start, first = time.time(), _highest_step(run)
    deletions: list[tuple[float, str]] = []
    skipped: list[str] = []  # due but not serving (still being replaced): reported, not lost
    recoveries: list[float] = []
    watches: list[ReplacementWatch] = []
    next_delete = start + every
    k = spec.seed
    while time.time() < start + window:
        if spec.delete and time.time() >= next_delete:
            n = int(run.status().get("incarnation") or 0)
            victim = victim_of(run, n, k)
            if spec.elastic and delete_watched(run, victim, deletions, watches):
                k += 1
            elif not spec.elastic and victim in run.serving_member_uids():
                at = time.time()
                run.delete_pod(victim)
                deletions.append((at, victim))
                k += 1
                resumed = _first_step_after(run, at, n + 1)  # timed inline: the next one waits
                if resumed is not None:
                    recoveries.append(resumed - at)
            else:
                skipped.append(victim)
            next_delete = max(next_delete + every, time.time() + 1)
        time.sleep(0.05)
    steps = _highest_step(run) - first
    elapsed = time.time() - start
    status = run.status()
    result: dict[str, Any] = {
        "seed": spec.seed,
        "window_s": round(elapsed, 1),
        "steps": steps,
        "steps_per_min": round(steps / elapsed * 60, 2),
        "deletions": len(deletions),
        "deletions_skipped (not serving when due)": skipped,
        "incarnations": int(status.get("incarnation") or 0),
        "deleted_at": [round(at, 3) for at, _ in deletions],
        "window_end": round(start + elapsed, 3),
    }
    if spec.delete and spec.elastic:
        result.update((replacements or _replacements)(run, status, deletions, watches))
    if spec.delete and not spec.elastic:
        result["loss_to_training_again_s"] = _stats(recoveries)
    return result


def _replacements(
    run: EmbeddedRun,
    status: dict[str, Any],
    deletions: list[tuple[float, str]],
    watches: list[ReplacementWatch],
) -> dict[str, Any]:
    """Every deletion's report (:func:`deletion_report`: none dropped), and over them the
    stats of loss -> re-admitted / first ``/run`` and of each stage."""
    window_end = time.time()
    for watch in watches:
        watch.join(timeout=5)
    reports = [
        deletion_report(w.at, w.victim, {**w.times, **_marker_times(run, w)}, window_end)
        | _gym_start(run, w)
        for w in watches
    ]
    replaced = member_replacements(status).get("gym", {})
    readmitted = [
        r["trainer_readmitted"] + sum(r[k] for k, _ in STAGES[:4])
        for r in reports
        if "trainer_readmitted" in r
    ]
    return {
        "loss_to_readmitted_s": _stats(readmitted),
        "loss_to_first_run_s": _stats([r["total"] for r in reports if "total" in r]),
        "loss_to_ready_s (operator)": _stats(replaced.get("recent_s") or []),
        "replacements": replaced.get("count", 0),
        "outcomes": {o: sum(r["outcome"] == o for r in reports) for o in OUTCOMES},
        "breakdown_s": _breakdown_stats(reports),
        "per_deletion": reports,
    }


def _seed(seed: int, work: Path, args: argparse.Namespace, before: Path | None) -> dict[str, Any]:
    window, every, level, standby = args.window, args.every, args.level, args.gym_standby
    arms = {
        "undisturbed": arm(Arm(f"undisturbed-{seed}", True, False, seed, None, standby), work,
                           window=window, every=every, level=level),
        "elastic": arm(Arm(f"elastic-{seed}", True, True, seed, None, standby), work,
                       window=window, every=every, level=level),
    }  # fmt: skip
    if before is not None:
        spec = Arm(f"elastic-before-{seed}", True, True, seed, before)
        arms["elastic_before"] = arm(spec, work, window=window, every=every, level=level)
    if seed == 0 and not args.quick:
        arms["ending"] = arm(
            Arm(f"ending-{seed}", False, True, seed, None, standby), work, window=window,
            every=every, level=level,
        )  # fmt: skip
    base = arms["undisturbed"]["steps_per_min"] or 1.0
    result: dict[str, Any] = {"seed": seed, **arms}
    for name in arms:
        if name != "undisturbed":
            result[f"{name}_vs_undisturbed"] = round(arms[name]["steps_per_min"] / base, 3)
    return result


def interleaved(
    seed: int, work: Path, *, every: float, pairs: int, level: str = "sibling", gym_standby: int = 0
) -> dict[str, Any]:
    """One elastic run, its window alternating undisturbed (U) and disturbed (D) segments
    of ``2 * every`` seconds in ABBA order: the seed's rates of both and their ratio, the
    per-pair ratios, and the disturbed segments' replacements (as the ``elastic`` arm's)."""
    segment = 2 * every
    order = abba_pairs(pairs)
    document = _document(True, seed, level, gym_standby)
    with EmbeddedRun(document, work / f"interleaved-{seed}") as run:
        wait(lambda: _highest_step(run) >= 2, f"interleaved-{seed}: training", bound=600)
        deletions: list[tuple[float, str]] = []
        watches: list[ReplacementWatch] = []
        victims = iter(range(seed, seed + 4 * pairs))
        segments: list[tuple[str, int, float]] = []
        for pair in order:
            for kind in pair:
                steps, elapsed = _segment(run, kind == "D", segment, every, victims,
                                          deletions, watches)  # fmt: skip
                segments.append((kind, steps, elapsed))
        status = run.status()
        replaced = _replacements(run, status, deletions, watches)
    rates = interleaved_rates(segments)
    disturbed_s = sum(t for kind, _, t in segments if kind == "D")
    lost = (1 - rates["elastic_vs_undisturbed"]) * disturbed_s / max(len(deletions), 1)
    return {"seed": seed, **rates, "deletions": len(deletions),
            "training_lost_per_deletion_s": round(lost, 2),
            "incarnations": int(status.get("incarnation") or 0),
            "elastic": {"deletions": len(deletions), **replaced}}  # fmt: skip


def _segment(
    run: EmbeddedRun,
    delete: bool,
    seconds: float,
    every: float,
    victims: Any,
    deletions: list[tuple[float, str]],
    watches: list[ReplacementWatch],
) -> tuple[int, float]:
    """Train ``seconds``; when ``delete``, delete a serving Gym at once and every ``every``
    seconds (a Gym still being replaced is skipped for the other). Steps trained, elapsed."""
    start, first = time.time(), _highest_step(run)
    next_delete = start if delete else float("inf")
    while time.time() < start + seconds:
        if time.time() >= next_delete:
            n = int(run.status().get("incarnation") or 0)
            for _ in range(2):
                if delete_watched(run, f"bench-i{n}-gym-{next(victims) % 2}", deletions, watches):
                    break
            next_delete += every
        time.sleep(0.05)
    return _highest_step(run) - first, time.time() - start


def paired(
    seed: int,
    work: Path,
    *,
    window: float,
    every: float,
    before: Path | None = None,
    level: str = "sibling",
    gym_standby: int = 0,
) -> dict[str, Any]:
    """The undisturbed and the elastic arm of ``seed`` (and, with ``before``, the elastic
    arm on that runtime, no standby Gym: its trainer predates them) at once, each in its own
    process and local cluster: all train until ready, then their windows start together (the
    same load at the same run age); each elastic arm's ratio is over the undisturbed arm."""
    sync = work / f"sync-{seed}"
    sync.mkdir()
    names = ["undisturbed", "elastic", *(["elastic_before"] if before is not None else [])]
    children = {
        name: subprocess.Popen(
            [sys.executable, "-m", "bench.elastic", "--arm", name, "--arm-seed", str(seed),
             "--window", str(window), "--every", str(every), "--work", str(work),
             "--sync", str(sync), "--level", level,
             "--gym-standby", str(0 if name == "elastic_before" else gym_standby),
             *(["--arm-runtime", str(before)] if name == "elastic_before" else [])],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in names
    }  # fmt: skip
    try:
        wait(
            lambda: (
                all((sync / f"{name}.ready").exists() for name in children)
                or any(child.poll() is not None for child in children.values())
            ),
            f"seed {seed}: all arms training",
            bound=900,
        )
        (sync / "go").touch()
        arms = {name: _arm_answer(name, child) for name, child in children.items()}
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
    steps = {name: trainer_step_times(work / f"{name}-{seed}") for name in names}
    cpu = {name: arms[name].pop("pod_cpu", []) for name in names}
    for name in names[1:]:  # where each elastic arm's rate (and CPU) went, deletion by deletion
        at = arms[name]["deleted_at"]
        arms[name]["steps_around_deletions"] = steps_around_deletions(
            at, steps[name], steps[names[0]]
        )
        arms[name]["cpu_around_deletions"] = cpu_around_deletions(at, cpu[name], cpu[names[0]])
        arms[name]["rollouts_around_deletions"] = rollouts_around_deletions(
            at, *(trace_times(work / f"{arm}-{seed}") for arm in (name, names[0]))
        )
    for name in names if gym_standby else []:  # when the standbys took work (their trace)
        arms[name]["standby_work"] = arm_standby_work(
            work / f"{name}-{seed}", gym_standby, arms[name]
        )
    base = arms["undisturbed"]["steps_per_min"] or 1.0
    ratios = {f"{name}_vs_undisturbed": round(arms[name]["steps_per_min"] / base, 3)
              for name in names[1:]}  # fmt: skip
    return {"seed": seed, **arms, **ratios}


def _arm_answer(name: str, child: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = child.communicate(timeout=1200)
    if child.returncode != 0:
        raise RuntimeError(f"the {name} arm exited {child.returncode}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def paired_arm(args: argparse.Namespace) -> None:
    """One arm of :func:`paired` (this process): train, say ready, wait for the go, run
    the window, print its result as the last line."""
    delete = args.arm != "undisturbed"
    runtime = Path(args.arm_runtime) if args.arm_runtime else None
    spec = Arm(f"{args.arm}-{args.arm_seed}", True, delete, args.arm_seed, runtime)
    sync = Path(args.sync)
    os.environ.update(_pods_pythonpath(spec.runtime))  # this process's pods only
    document = _document(True, spec.seed, args.level, args.gym_standby)
    with EmbeddedRun(document, Path(args.work) / spec.name) as run:
        wait(lambda: _highest_step(run) >= 2, f"{spec.name}: training", bound=600)
        sampler = PodCpuSampler(lambda: {str(p.metadata.uid): n for n, p in run.pods().items()})
        sampler.start()  # every arm alike: its pods' CPU (cpu_around_deletions)
        (sync / f"{args.arm}.ready").touch()
        wait(lambda: (sync / "go").exists(), f"{spec.name}: the go", bound=900)
        result = _window(run, spec, args.window, args.every)
        sampler.stop()
    print(json.dumps({**result, "pod_cpu": pod_cpu_rows(sampler.rows, sampler.names)}))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=90.0, help="seconds trained per arm")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between deletions")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (runs of every arm)")
    parser.add_argument("--quick", action="store_true", help="a 40 s window, no ending arm")
    parser.add_argument(
        "--before",
        default=None,
        help="git ref or checkout directory (/tmp/base25): an elastic arm on its runtime",
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="per seed one run alternating undisturbed/disturbed segments (the rate's ratio)",
    )
    parser.add_argument("--pairs", type=int, default=4, help="U/D segment pairs (--interleaved)")
    parser.add_argument(
        "--paired",
        action="store_true",
        help="per seed the undisturbed and elastic arms at the same time (separate processes)",
    )
    # a --paired arm's process:
    for internal in ("--arm", "--arm-seed", "--work", "--sync", "--arm-runtime"):
        parser.add_argument(internal, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--role", choices=("gym", "worker"), default="gym", help="whose pods are deleted"
    )
    parser.add_argument(
        "--level",
        choices=("sibling", "turn"),
        default="sibling",
        help="--role gym: the asynchronous run (sibling snapshots) or a multi-turn task "
        "with turn-level snapshots",
    )
    parser.add_argument(
        "--standby", type=int, default=1, help="--role worker: a standby arm with N standby pods"
    )
    parser.add_argument(
        "--gym-standby",
        type=int,
        default=0,
        help="--role gym: spec.gym.standby of every arm (not --before's: its trainer predates it)",
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.arm is not None:
        args.arm_seed = int(args.arm_seed)
        paired_arm(args)
        return
    if args.quick:
        args.window = 40.0
    if args.role == "worker":  # the worker arms (bench/elastic_workers.py)
        from .elastic_workers import worker_main

        worker_main(args)
        return
    Path(".rolloutrun").mkdir(exist_ok=True)  # pods see the work dir (not a private /tmp)
    with tempfile.TemporaryDirectory(prefix="bench-elastic-", dir=".rolloutrun") as tmp:
        work = Path(tmp).resolve()
        before = runtime_at(args.before, work / "before") if args.before else None
        here = runtime_here(work / "here")  # this tree, compiled: the pods' PYTHONPATH first
        inherited = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(here), *([inherited] if inherited else [])])
        if args.paired:
            per_seed = [
                paired(
                    seed,
                    work,
                    window=args.window,
                    every=args.every,
                    before=before,
                    level=args.level,
                    gym_standby=args.gym_standby,
                )
                for seed in range(args.seeds)
            ]
        elif args.interleaved:
            per_seed = [
                interleaved(
                    seed,
                    work,
                    every=args.every,
                    pairs=args.pairs,
                    level=args.level,
                    gym_standby=args.gym_standby,
                )
                for seed in range(args.seeds)
            ]
        else:
            per_seed = [_seed(seed, work, args, before) for seed in range(args.seeds)]
    print(
        json.dumps(
            {
                "every_s": args.every,
                "window_s": args.window,
                "before": args.before,
                "level": args.level,
                "gym_standby": args.gym_standby,
                **(
                    {"gym_standby_note": "the elastic_before arm runs without standby Gyms"}
                    if args.gym_standby and before is not None
                    else {}
                ),
                "stages": dict(STAGES),
                "seeds": per_seed,
                "over_seeds": over_seeds(per_seed),
                **(
                    {"over_seeds_before": over_seeds(per_seed, "elastic_before")}
                    if before is not None and (args.paired or not args.interleaved)
                    else {}
                ),
                "note": "arms run back to back in one process on a possibly shared machine",
                "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

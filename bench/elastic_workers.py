"""The worker arms of ``bench/elastic.py`` (``python -m bench.elastic --role worker``).

The run of the Gym arms with its generation on :data:`WORKER_PODS` worker pods (Ray actors,
the trainer the Ray head): a worker pod deleted every ``--every`` seconds, elastic versus
undisturbed (and, first seed without ``--quick``, ending the incarnation: the operator's
``elasticMembers: false``), per arm and over ``--seeds`` seeds, side by side in one process.
Per deletion, the seconds from it to each of :data:`WORKER_STAGES`: the old pod gone, the
trainer finding the actor dead (a refit's ``RayActorError``) and starting its replacement,
the replacement pod created and Running, and the replacement actor re-admitted (its
endpoint is named by the next dispatch, round robin: the replacement doing work). With
``--standby N`` (default 1) an arm ``standby`` runs beside them, per seed in the same
process: the elastic arm with ``spec.workers.standby: N`` (warm standby worker pods, one
taking a lost worker's place at once). In every elastic arm the pod deleted is one whose
actor serves (read from the trainer's log: the first placement, then each re-admission's
address), round robin over those: without standbys that is every worker pod, as before;
with them a deletion never hits an idle standby (which would cost nothing). With
``--before REF`` an arm ``elastic_before`` runs the elastic arm with its pods (trainer and
workers) on the runtime of git ``REF`` (the operator is this tree's), the before/after in
one run; this tree's pods run a byte-compiled copy of its ``runtime/``, as ``REF``'s do.
Goals
(issue 14) on the worst seed: rate >= 90 % of undisturbed; loss -> replacement doing work
<= 5 s. Kept apart from ``bench/elastic.py`` (which holds the Gym arms and the helpers both
use) so that module stays under 600 lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements

from .elastic import (
    Arm,
    ReplacementWatch,
    _document,
    _highest_step,
    _log_times,
    _pods_pythonpath,
    _spread,
    _stats,
    _window,
    runtime_at,
    runtime_here,
)
from .operator_recovery import wait

#: Generation workers of the worker arms: Ray actors, one per worker pod (the trainer is the
#: Ray head; ``spec.workers.replicas``).
WORKER_PODS = 2
#: The worker arms' Lease duration (seconds; the operator's default).
WORKER_LEASE_S = 15
#: The trainer's log lines of a lost actor and of its replacement re-admitted at a refit
#: (:mod:`rolloutrun_runtime.workers.ray_workers`); the next dispatch names the re-admitted
#: endpoint (round robin), so re-admission is when the replacement starts doing work.
WORKER_LOST = "lost ("
WORKER_READMITTED = "re-admitted at version"
#: The trainer's log line of the first placement (its endpoints, by index).
WORKER_PLACED = "Ray generation workers at "
URL = re.compile(r"http://[^'\s,\]]+")
#: Per worker deletion, the moments reported (seconds after the deletion).
WORKER_STAGES = (
    ("old_pod_gone", "the old pod is gone (its processes ended)"),
    ("trainer_saw_loss", "the trainer found the actor dead and started its replacement"),
    ("new_pod_created", "the operator created the replacement worker pod"),
    ("pod_running", "the kubelet reports the replacement Running (ray_node started)"),
    ("readmitted", "the replacement actor re-admitted at a refit: it serves the next call"),
)


def _worker_document(elastic: bool, seed: int, standby: int = 0) -> dict[str, Any]:
    """The Gym arms' run with its generation on :data:`WORKER_PODS` worker pods (and
    ``standby`` standby worker pods)."""
    document = _document(elastic, seed)
    spec = document["spec"]
    # Ray's start (head, driver, actors) holds the trainer's loop for seconds on a loaded
    # machine: the Gym arms' 4 s Lease then expires under it (the trainer fenced at start)
    spec["recovery"]["leaseDurationSeconds"] = WORKER_LEASE_S
    spec["workers"] = {"replicas": WORKER_PODS, "standby": standby}
    spec["run"]["workers"] = {"backend": "ray", "generationWorkers": WORKER_PODS}
    return document


def serving_urls(lines: list[str]) -> dict[int, str]:
    """Index -> address of the actor serving it, from the trainer's log lines (in order):
    the first placement, then each re-admission (a replacement, or a standby taking over)."""
    serving: dict[int, str] = {}
    for line in lines:
        if WORKER_PLACED in line:
            serving = dict(enumerate(URL.findall(line.split(" placed ", 1)[0])))
        elif WORKER_READMITTED in line and (found := URL.findall(line)):
            index = re.search(r"generation worker (\d+) re-admitted", line)
            if index:
                serving[int(index.group(1))] = found[-1]
    return serving


def active_victim(run: EmbeddedRun, n: int, k: int) -> str:
    """The ``k``-th worker pod to delete: round robin over the pods whose actor serves."""
    lines: list[str] = []
    logs = (run.work_dir / "cluster").glob(f"pods/*/*-i{n}-trainer*/logs/trainer.log")
    for log in sorted(logs):
        lines += log.read_text(errors="replace").splitlines()
    hosts = {url.split("//", 1)[1].rsplit(":", 1)[0] for url in serving_urls(lines).values()}
    prefix = f"bench-i{n}-worker-"
    active = sorted(
        name
        for name, pod in run.pods().items()
        if name.startswith(prefix) and pod.status.pod_ip in hosts
    )
    return active[k % len(active)] if active else f"{prefix}{k % WORKER_PODS}"


def worker_arm(
    spec: Arm, work: Path, *, window: float, every: float, standby: int = 0
) -> dict[str, Any]:
    """One worker arm: start, wait for training, run ``window`` seconds deleting worker
    pods whose actor serves every ``every`` seconds (with ``spec.delete``)."""
    document = _worker_document(spec.elastic, spec.seed, standby)
    saved = os.environ.get("PYTHONPATH")
    os.environ.update(_pods_pythonpath(spec.runtime))  # --before: the pods run REF's runtime
    try:
        return _worker_window(spec, document, work, window=window, every=every)
    finally:
        os.environ.pop("PYTHONPATH", None)
        if saved is not None:
            os.environ["PYTHONPATH"] = saved


def _worker_window(
    spec: Arm, document: dict[str, Any], work: Path, *, window: float, every: float
) -> dict[str, Any]:
    standby = int(document["spec"]["workers"].get("standby") or 0)
    with EmbeddedRun(document, work / spec.name) as run:
        wait(lambda: _highest_step(run) >= 2, f"{spec.name}: training", bound=600)
        return _window(
            run,
            spec,
            window,
            every,
            role="worker",
            members=WORKER_PODS,
            replacements=_worker_replacements,
            # with standbys, a serving pod (the log names them); without, every pod serves:
            # round robin (a --before runtime's log does not name re-admitted addresses)
            pick=active_victim if standby else None,
        )


def _worker_replacements(
    run: EmbeddedRun,
    status: dict[str, Any],
    deletions: list[tuple[float, str]],
    watches: list[ReplacementWatch],
) -> dict[str, Any]:
    """Per deletion, seconds from it to each of :data:`WORKER_STAGES` (the trainer's log
    lines: the first after the deletion; a deletion whose replacement was not re-admitted
    before the next deletion or the window's end has no ``readmitted``)."""
    for watch in watches:
        watch.join(timeout=5)
    lost, readmitted = _log_times(run, WORKER_LOST), _log_times(run, WORKER_READMITTED)
    samples: list[dict[str, float]] = []
    for (at, _), watch, until in zip(
        deletions, watches, [d for d, _ in deletions[1:]] + [float("inf")], strict=True
    ):
        times = {key: t - at for key, t in watch.times.items()}
        for key, found in (("trainer_saw_loss", lost), ("readmitted", readmitted)):
            after = [t for t in found if at - 0.5 <= t < until]
            if after:
                times[key] = after[0] - at
        samples.append({key: round(value, 3) for key, value in times.items()})
    replaced = member_replacements(status).get("worker", {})
    return {
        "loss_to_readmitted_s": _stats([s["readmitted"] for s in samples if "readmitted" in s]),
        "not_readmitted": sum("readmitted" not in s for s in samples),
        "loss_to_ready_s (operator)": _stats(replaced.get("recent_s") or []),
        "replacements": replaced.get("count", 0),
        "stages_after_deletion_s": {
            key: _stats([s[key] for s in samples if key in s]) for key, _ in WORKER_STAGES
        },
    }


def _worker_seed(
    seed: int, work: Path, args: argparse.Namespace, before: Path | None = None
) -> dict[str, Any]:
    """The worker arms of one seed, back to back: undisturbed, elastic, and (first seed,
    not ``--quick``) ending (each lost worker ends the incarnation)."""
    window, every = args.window, args.every
    arms = {
        "undisturbed": worker_arm(
            Arm(f"workers-undisturbed-{seed}", True, False, seed), work, window=window, every=every
        ),
        "elastic": worker_arm(
            Arm(f"workers-elastic-{seed}", True, True, seed), work, window=window, every=every
        ),
    }
    if before is not None:  # the same elastic arm, its pods on the runtime of --before REF
        arms["elastic_before"] = worker_arm(
            Arm(f"workers-elastic-before-{seed}", True, True, seed, before),
            work,
            window=window,
            every=every,
        )
    if args.standby:
        arms["standby"] = worker_arm(
            Arm(f"workers-standby-{seed}", True, True, seed),
            work,
            window=window,
            every=every,
            standby=args.standby,
        )
    if seed == 0 and not args.quick:
        arms["ending"] = worker_arm(
            Arm(f"workers-ending-{seed}", False, True, seed), work, window=window, every=every
        )
    base = arms["undisturbed"]["steps_per_min"] or 1.0
    result: dict[str, Any] = {"seed": seed, **arms}
    for name in arms:
        if name != "undisturbed":
            result[f"{name}_vs_undisturbed"] = round(arms[name]["steps_per_min"] / base, 3)
    return result


def worker_over_seeds(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, spread and worst seed of the elastic/undisturbed ratio and of the loss ->
    re-admitted time (each seed's max), the goals checked on the worst seed; a deletion
    whose replacement never got to work within the window fails the time goal."""
    return {
        arm: _arm_over_seeds(per_seed, arm)
        for arm in ("elastic", "elastic_before", "standby")
        if all(arm in s for s in per_seed)
    }


def _arm_over_seeds(per_seed: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    ratios = [s[f"{arm}_vs_undisturbed"] for s in per_seed]
    recovery = [s[arm]["loss_to_readmitted_s"].get("max") for s in per_seed]
    missing = sum(int(s[arm].get("not_readmitted") or 0) for s in per_seed)
    times = [t for t in recovery if t is not None]
    worst_rate = min(range(len(per_seed)), key=lambda i: ratios[i])
    worst_time = max(range(len(per_seed)), key=lambda i: recovery[i] or 0.0)
    return {
        "vs_undisturbed": _spread(ratios),
        "loss_to_readmitted_max_s": _spread(times),
        "deletions_never_readmitted": missing,
        "worst_seed_rate": per_seed[worst_rate]["seed"],
        "worst_seed_replacement": per_seed[worst_time]["seed"],
        "goals_on_worst_seed": {
            "rate >= 0.90 of undisturbed": ratios[worst_rate] >= 0.9,
            "loss -> replacement doing work <= 5 s (max)": bool(times)
            and max(times) <= 5.0
            and missing == 0,
        },
    }


def worker_main(args: argparse.Namespace) -> None:
    """``--role worker``: the worker arms over ``--seeds`` seeds, one JSON document."""
    Path(".rolloutrun").mkdir(exist_ok=True)  # pods see the work dir (not a private /tmp)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-elastic-workers-", dir=".rolloutrun") as tmp:
        work = Path(tmp).resolve()
        before = runtime_at(args.before, work / "before") if args.before else None
        here = runtime_here(work / "here")  # this tree, compiled: the pods' PYTHONPATH first
        inherited = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(here), *([inherited] if inherited else [])])
        per_seed = [_worker_seed(seed, work, args, before) for seed in range(args.seeds)]
    print(
        json.dumps(
            {
                "role": "worker",
                "worker_pods": WORKER_PODS,
                "standby_pods": args.standby,
                "before": args.before,
                "every_s": args.every,
                "window_s": args.window,
                "stages": dict(WORKER_STAGES),
                "seeds": per_seed,
                "over_seeds": worker_over_seeds(per_seed),
                "load_average_1_5_15": {
                    "before": [round(x, 2) for x in load_before],
                    "after": [round(x, 2) for x in os.getloadavg()],
                },
                "note": "arms run back to back in one process on a possibly shared machine",
            },
            indent=1,
        )
    )

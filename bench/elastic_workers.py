"""The worker arms of ``bench/elastic.py`` (``python -m bench.elastic --role worker``).

The run of the Gym arms with its generation on :data:`WORKER_PODS` worker pods (Ray actors,
the trainer the Ray head), each arm with ``--standby N`` (default 1) standby worker pods
(``spec.workers.standby``: warm standby actors, one taking a lost worker's place at once),
the undisturbed arm too, so that the rates compare runs of the same pods on the same cores:
``undisturbed`` (nothing deleted) and ``standby`` (``elastic`` with ``--standby 0``): a
worker pod deleted every ``--every`` seconds. With ``--before REF`` the disturbed arm again
with its pods (trainer and workers) on the runtime of git ``REF`` (the operator is this
tree's), the before/after in one run; this tree's pods run a byte-compiled copy of its
``runtime/``, as ``REF``'s do. Without ``--quick``, first seed: ``ending`` (the operator's
``elasticMembers: false``). Arms run back to back in one process, per seed, odd seeds in the
reverse order; each arm's window starts once it trains and its standby pool is full.

The pod deleted is one whose actor serves (:class:`Victims`: the trainer's log names the
first placement, each re-admission's address and each loss), round robin over those. Each
deletion is reported (``per_deletion``): the pod, what it was (``active`` with its index,
``standby``, or ``starting``: a refill pod whose actor has not started), and from the
trainer's log the seconds to the loss reported (``detected_after_s``) and to the
replacement doing work (``doing_work_after_s``: its re-admission, after which the next
dispatch may name it; ``via`` a standby ready at the loss, a ``refill standby`` that started
later, or a new pod), or ``not_readmitted`` saying why;
a standby or starting pod's deletion is counted by its refill standby started
(``refill_ready_after_s``). Outcomes are waited for up to :data:`SETTLE_S` after a deletion,
past the window's end (whose rate is measured already). Also per deletion the pod stages
(:data:`WORKER_STAGES`). Goals (issue 14) on the worst seed: rate >= 90 % of undisturbed;
loss -> replacement doing work <= 5 s for every deletion of an active pod. Kept apart from
``bench/elastic.py`` (which holds the Gym arms and the helpers both use) so that module stays
under 600 lines.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements
from rolloutrun_runtime.workers import STANDBY_ADMITTED_LOG, STANDBY_LOST_LOG, STANDBY_STARTED_LOG

from .elastic import (
    Arm,
    ReplacementWatch,
    _document,
    _highest_step,
    _pods_pythonpath,
    _spread,
    _stats,
    _window,
    runtime_at,
    runtime_here,
)
from .elastic_report import TRAINER_STEP
from .operator_recovery import wait
from .pod_cpu import PodCpuSampler, cpu_after_deletions, processes_after_deletions

#: Generation workers of the worker arms: Ray actors, one per worker pod (the trainer is the
#: Ray head; ``spec.workers.replicas``).
WORKER_PODS = 2
#: The worker arms' Lease duration (seconds; the operator's default).
WORKER_LEASE_S = 15
#: The trainer's log lines (:mod:`rolloutrun_runtime.workers.ray_workers`): an active actor
#: lost, its index re-admitted (the next dispatch may name it: the replacement doing work),
#: the first placement (its endpoints, by index), a standby started, admitted under an
#: index, and lost while waiting.
WORKER_LOST = "lost ("
WORKER_READMITTED = "re-admitted at version"
WORKER_PLACED = "Ray generation workers at "
URL = re.compile(r"http://[^'\s,\]()]+")
#: Seconds after a deletion the bench waits (past the window) for what became of it.
SETTLE_S = 60.0
#: A runtime that does not log its standbys (``--before``'s): the window starts once every
#: worker pod has been Running this long.
POOL_SETTLE_S = 20.0
#: A standby admitted this long after the loss was not ready at it (the refill's start).
REFILL_WAIT_S = 1.0
#: What each pod of the worker arms asks for (``resources``), every arm alike: on one node of
#: the machine's CPUs (2 here) the trainer is promised a core, the Gyms and generation
#: workers a fifth each (their requests fill the node), and a worker pod may burst to one
#: core. The local cluster enforces them as a kubelet does (per-pod CPU cgroups,
#: :mod:`rolloutrun_localcluster.cpucontrol`), so a refill pod's start (a Ray node and
#: its actor's imports) takes its share, not the trainer's.
WORKER_ARM_RESOURCES: dict[str, dict[str, Any]] = {
    "trainer": {"requests": {"cpu": "1"}},
    "gym": {"requests": {"cpu": "200m"}},
    "workers": {"requests": {"cpu": "200m"}, "limits": {"cpu": "1"}},
}
#: Per worker deletion, the pods' moments reported (seconds after the deletion).
WORKER_STAGES = (
    ("old_pod_gone", "the old pod is gone (its processes ended)"),
    ("new_pod_created", "the operator created the replacement worker pod"),
    ("pod_running", "the kubelet reports the replacement Running (ray_node started)"),
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
    for member, resources in WORKER_ARM_RESOURCES.items():
        spec.setdefault(member, {})["resources"] = copy.deepcopy(resources)
    return document


def trainer_lines(run: EmbeddedRun) -> list[tuple[float, str]]:
    """Every incarnation's trainer log lines with their epoch times, in time order."""
    lines: list[tuple[float, str]] = []
    for log in sorted((run.work_dir / "cluster").glob("pods/*/*-trainer-*/logs/trainer.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            lines.append((stamp, line))
    return sorted(lines, key=lambda entry: entry[0])


def _index(line: str, pattern: str) -> int | None:
    found = re.search(pattern, line)
    return int(found.group(1)) if found else None


def serving_urls(lines: list[str]) -> dict[int, str]:
    """Index -> address of the actor serving it, from the trainer's log lines (in order):
    the first placement, then each re-admission (a replacement, or a standby taking over);
    an index whose actor was reported lost serves nowhere until its re-admission."""
    serving: dict[int, str] = {}
    for line in lines:
        if WORKER_PLACED in line:
            serving = dict(enumerate(URL.findall(line.split(" placed ", 1)[0])))
        elif WORKER_READMITTED in line and (found := URL.findall(line)):
            index = _index(line, r"generation worker (\d+) re-admitted")
            if index is not None:
                serving[index] = found[-1]
        elif WORKER_LOST in line:
            index = _index(line, r"generation worker (\d+) lost \(")
            if index is not None:
                serving.pop(index, None)
    return serving


def standby_urls(lines: list[str]) -> set[str]:
    """Addresses of the started standbys not yet admitted (:data:`STANDBY_STARTED_LOG` lines
    less :data:`STANDBY_ADMITTED_LOG` ones; a runtime that does not log them: none)."""
    pool: set[str] = set()
    for line in lines:
        if STANDBY_STARTED_LOG in line or STANDBY_ADMITTED_LOG in line:
            found = URL.findall(line)
            if found and STANDBY_STARTED_LOG in line:
                pool.add(found[0])
            elif found:
                pool.discard(found[0])
    return pool


def _host(url: str) -> str:
    return url.split("//", 1)[1].rsplit(":", 1)[0]


@dataclasses.dataclass
class Victims:
    """``pick`` of :func:`bench.elastic._window`: the ``k``-th worker pod deleted, round robin
    over the pods whose actor serves (by the trainer's log at that moment); per pick, the
    pod and what it was: ``active`` (serving index ``index``), ``standby`` (a started
    standby) or ``starting`` (its actor not started: a refill pod)."""

    picks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __call__(self, run: EmbeddedRun, n: int, k: int) -> str:
        lines = [line for _, line in trainer_lines(run)]
        serving = {_host(url): index for index, url in serving_urls(lines).items()}
        standbys = {_host(url) for url in standby_urls(lines)}
        pods = {
            name: pod.status.pod_ip
            for name, pod in run.pods().items()
            if name.startswith(f"bench-i{n}-worker-")
        }
        active = sorted(name for name, ip in pods.items() if ip in serving)
        victim = active[k % len(active)] if active else f"bench-i{n}-worker-{k % WORKER_PODS}"
        ip = pods.get(victim)
        kind = "active" if ip in serving else "standby" if ip in standbys else "starting"
        self.picks.append(
            {"pod": victim, "kind": kind, "index": serving.get(ip or ""), "at": time.time()}
        )
        return victim


def worker_arm(
    spec: Arm, work: Path, *, window: float, every: float, standby: int = 0
) -> dict[str, Any]:
    """One worker arm: start, wait for training (and the standby pool full), run ``window``
    seconds deleting worker pods whose actor serves every ``every`` seconds (with
    ``spec.delete``)."""
    document = _worker_document(spec.elastic, spec.seed, standby)
    saved = os.environ.get("PYTHONPATH")
    os.environ.update(_pods_pythonpath(spec.runtime))  # --before: the pods run REF's runtime
    try:
        return _worker_window(spec, document, work, window=window, every=every)
    finally:
        os.environ.pop("PYTHONPATH", None)
        if saved is not None:
            os.environ["PYTHONPATH"] = saved


def _pool_ready(run: EmbeddedRun, standby: int, logged: bool, since: list[float]) -> bool:
    """Whether the ``standby`` standbys serve (their log lines; a runtime that does not log
    them: every worker pod Running for :data:`POOL_SETTLE_S`)."""
    if logged:
        return len(standby_urls([line for _, line in trainer_lines(run)])) >= standby
    pods = [p for name, p in run.pods().items() if "-worker-" in name]
    running = len(pods) >= WORKER_PODS + standby and all(p.status.phase == "Running" for p in pods)
    if not running:
        since.clear()
        return False
    since[:] = since or [time.time()]
    return time.time() - since[0] >= POOL_SETTLE_S


def _worker_window(
    spec: Arm, document: dict[str, Any], work: Path, *, window: float, every: float
) -> dict[str, Any]:
    standby = int(document["spec"]["workers"].get("standby") or 0)
    victims = Victims()
    with EmbeddedRun(document, work / spec.name) as run:
        wait(lambda: _highest_step(run) >= 2, f"{spec.name}: training", bound=600)
        if standby:  # the window starts with the pool full, in every arm alike
            logged, since = spec.runtime is None, []  # type: ignore[var-annotated]
            wait(lambda: _pool_ready(run, standby, logged, since), f"{spec.name}: pool", 600)
        sampler = PodCpuSampler(lambda: {str(p.metadata.uid): n for n, p in run.pods().items()})
        sampler.start()
        try:
            result = _window(
                run,
                spec,
                window,
                every,
                role="worker",
                members=WORKER_PODS,
                replacements=lambda *a: _worker_replacements(
                    *a, picks=victims.picks, sampler=sampler, span=every
                ),
                pick=victims,
            )
            if "cpu_after_deletion_s" not in result:  # nothing deleted: the window's CPU
                result["cpu_in_window_s"] = _cpu_report(run, sampler, [], [], every)
        finally:
            sampler.stop()
    return {"standby_pods": standby, **result}


def _outcome(
    lines: list[tuple[float, str]], at: float, pick: dict[str, Any], waited: float
) -> dict[str, Any]:
    """What became of one deletion, from the trainer's log lines: for an active pod the
    loss of its index reported (``detected_after_s``) and its next re-admission
    (``doing_work_after_s``, ``via`` a standby or a replacement pod), else why not; for a
    standby or starting pod the loss of a standby and the refill's start (``refill_ready``)."""
    after = [(t, line) for t, line in lines if t >= at - 0.5]
    index = pick["index"]

    def first(marker: str, since: float) -> float | None:
        return next((t for t, line in after if t >= since and marker in line), None)

    if pick["kind"] != "active":
        lost = first(STANDBY_LOST_LOG, at - 0.5)
        ready = first(STANDBY_STARTED_LOG, lost) if lost is not None else None
        out: dict[str, Any] = {"detected_after_s": lost, "refill_ready_after_s": ready}
        if ready is None:
            out["not_refilled"] = (
                f"no standby loss reported within {waited:.0f} s"
                if lost is None
                else f"the refill standby did not start within {waited:.0f} s"
            )
        return out
    lost = first(f"generation worker {index} lost (", at - 0.5)
    if lost is None:
        return {"not_readmitted": f"the trainer reported no loss of worker {index} "
                                  f"within {waited:.0f} s"}  # fmt: skip
    promoted = first(f"generation worker {index}{STANDBY_ADMITTED_LOG}", lost)
    readmitted = first(f"generation worker {index} re-admitted", lost)
    out = {"detected_after_s": lost, "doing_work_after_s": readmitted}
    if readmitted is None:
        out["not_readmitted"] = (
            f"a standby took the index but was not re-admitted within {waited:.0f} s"
            if promoted is not None
            else "no started standby at the loss (the pool refilling) and no replacement "
            f"actor started within {waited:.0f} s"
        )
    else:
        out["via"] = _via(lost, promoted, readmitted)
    return out


def _via(lost: float, promoted: float | None, readmitted: float) -> str:
    """Who took a lost index: a ``standby`` started at the loss, a ``refill standby`` that
    started later (none was ready at the loss: the pool refilling), or a ``new pod``."""
    if promoted is None or promoted > readmitted:
        return "new pod"
    return "standby" if promoted - lost <= REFILL_WAIT_S else "refill standby"


def _worker_replacements(
    run: EmbeddedRun,
    status: dict[str, Any],
    deletions: list[tuple[float, str]],
    watches: list[ReplacementWatch],
    *,
    picks: list[dict[str, Any]],
    sampler: PodCpuSampler | None = None,
    span: float = 15.0,
) -> dict[str, Any]:
    """Per deletion (in ``deletions``), what it hit and what became of it
    (:func:`_outcome`, the trainer's log, waited for up to :data:`SETTLE_S` after it,
    past the window's end: the window's rate is measured already), the pods' stages, and
    with a ``sampler`` the CPU each kind of pod spent in the ``span`` s after each deletion
    (:func:`bench.pod_cpu.cpu_after_deletions`, and per process of the trainer and refill
    pods: :func:`bench.pod_cpu.processes_after_deletions`) and the steps the trainer
    logged then."""
    samples: list[dict[str, Any]] = []
    deadline = max((at for at, _ in deletions), default=0.0) + SETTLE_S
    while True:
        lines = trainer_lines(run)
        samples = [
            _deletion(at, victim, _picked(picks, victim, at), lines, min(time.time(), deadline))
            for at, victim in deletions
        ]
        if time.time() > deadline or not any(_open(s) for s in samples):
            break
        time.sleep(0.5)
    for watch, sample in zip(watches, samples, strict=True):
        watch.join(timeout=5)
        sample.update({key: round(t - watch.at, 3) for key, t in watch.times.items()})
    active = [s for s in samples if s["kind"] == "active"]
    refills = [s for s in samples if s["kind"] != "active"]
    replaced = member_replacements(status).get("worker", {})
    cpu = {} if sampler is None else _cpu_report(run, sampler, deletions, watches, span)
    return {
        "loss_to_readmitted_s": _stats([s["doing_work_after_s"] for s in active
                                        if s.get("doing_work_after_s") is not None]),
        "loss_to_detected_s": _stats([s["detected_after_s"] for s in samples
                                      if s.get("detected_after_s") is not None]),
        "not_readmitted": sum("not_readmitted" in s for s in active),
        "standby_deletions_refill_ready_s": _stats([s["refill_ready_after_s"] for s in refills
                                                    if s.get("refill_ready_after_s")]),
        "loss_to_ready_s (operator)": _stats(replaced.get("recent_s") or []),
        "replacements": replaced.get("count", 0),
        "per_deletion": samples,
        "cpu_after_deletion_s": cpu,
        "stages_after_deletion_s": {
            key: _stats([s[key] for s in samples if s.get(key) is not None])
            for key, _ in WORKER_STAGES
        },
    }  # fmt: skip


def _cpu_report(
    run: EmbeddedRun,
    sampler: PodCpuSampler,
    deletions: list[tuple[float, str]],
    watches: list[ReplacementWatch],
    span: float,
) -> dict[str, Any]:
    """:func:`bench.pod_cpu.cpu_after_deletions` (each deletion's refill: the pod its watch
    saw replace it) once the last deletion's interval is over, with the steps the trainer
    logged in each interval and per ``span`` before the first deletion (the whole window
    without one)."""
    while deletions and time.time() < max(at for at, _ in deletions) + span:
        time.sleep(0.25)  # the last deletion's whole interval (the window's rate is read)
    if not sampler.rows:
        return {}
    start = sampler.rows[0][0]
    refills = [w.new_uid for w in watches] if watches else [None] * len(deletions)
    hit = [(at, victim, uid) for (at, victim), uid in zip(deletions, refills, strict=True)]
    cpu = cpu_after_deletions(sampler.rows, sampler.names, hit, span, start)
    cpu["by_process"] = processes_after_deletions(
        sampler.process_rows, sampler.names, hit, span, start
    )
    steps = [t for t, line in trainer_lines(run) if TRAINER_STEP in line]
    first = min((at for at, _ in deletions), default=sampler.rows[-1][0])
    cpu["steps_after_each"] = [sum(at <= t < at + span for t in steps) for at, _ in deletions]
    lead = first - start
    before = sum(start <= t < first for t in steps)
    cpu["steps_per_span_before"] = round(before * span / lead, 2) if lead >= 1.0 else None
    return cpu


def _deletion(
    at: float, victim: str, pick: dict[str, Any] | None, lines: list[tuple[float, str]], now: float
) -> dict[str, Any]:
    pick = pick or {"pod": victim, "kind": "unknown", "index": None}
    out = _outcome(lines, at, pick, now - at)
    times = {key: round(t - at, 3) for key, t in out.items() if isinstance(t, float)}
    return {**pick, **out, **times}


def _picked(picks: list[dict[str, Any]], victim: str, at: float) -> dict[str, Any] | None:
    """The pick of the deletion of ``victim`` at ``at``: its last pick before then (a
    replacement pod keeps its name)."""
    before = [p for p in picks if p["pod"] == victim and p["at"] <= at]
    if not before:
        return None
    return {key: value for key, value in before[-1].items() if key != "at"}


def _open(sample: dict[str, Any]) -> bool:
    return "not_readmitted" in sample or "not_refilled" in sample


def _worker_seed(
    seed: int, work: Path, args: argparse.Namespace, before: Path | None = None
) -> dict[str, Any]:
    """The worker arms of one seed, back to back, each with ``--standby`` standby pods (the
    undisturbed arm too: the same pods compete for the same cores): undisturbed, disturbed
    (``standby``, or ``elastic`` without standbys), with ``--before`` the disturbed arm on
    that runtime, and (first seed, not ``--quick``) ending (each lost worker ends the
    incarnation). Odd seeds run the arms in the reverse order (the machine's drift)."""
    window, every, standby = args.window, args.every, args.standby
    name = "standby" if standby else "elastic"
    runs: list[tuple[str, Arm]] = [
        ("undisturbed", Arm(f"workers-undisturbed-{seed}", True, False, seed)),
        (name, Arm(f"workers-{name}-{seed}", True, True, seed)),
    ]
    if before is not None:  # the same disturbed arm, its pods on the runtime of --before REF
        runs.append(
            (f"{name}_before", Arm(f"workers-{name}-before-{seed}", True, True, seed, before))
        )
    if seed == 0 and not args.quick:
        runs.append(("ending", Arm(f"workers-ending-{seed}", False, True, seed)))
    order = runs if seed % 2 == 0 else runs[::-1]
    arms = {
        key: worker_arm(spec, work, window=window, every=every, standby=standby)
        for key, spec in order
    }
    arms = {key: arms[key] for key, _ in runs}
    base = arms["undisturbed"]["steps_per_min"] or 1.0
    result: dict[str, Any] = {"seed": seed, "arm_order": [key for key, _ in order], **arms}
    for key in arms:
        if key != "undisturbed":
            result[f"{key}_vs_undisturbed"] = round(arms[key]["steps_per_min"] / base, 3)
    return result


def worker_over_seeds(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, spread and worst seed of the disturbed/undisturbed ratio and of the loss ->
    re-admitted time (each seed's max), the goals checked on the worst seed; a deletion of
    an active pod whose replacement never got to work fails the time goal."""
    return {
        arm: _arm_over_seeds(per_seed, arm)
        for arm in ("elastic", "elastic_before", "standby", "standby_before")
        if per_seed and all(arm in s for s in per_seed)
    }


def _arm_over_seeds(per_seed: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    ratios = [s[f"{arm}_vs_undisturbed"] for s in per_seed]
    recovery = [s[arm]["loss_to_readmitted_s"].get("max") for s in per_seed]
    missing = sum(int(s[arm].get("not_readmitted") or 0) for s in per_seed)
    kinds = [d["kind"] for s in per_seed for d in s[arm].get("per_deletion", [])]
    times = [t for t in recovery if t is not None]
    worst_rate = min(range(len(per_seed)), key=lambda i: ratios[i])
    worst_time = max(range(len(per_seed)), key=lambda i: recovery[i] or 0.0)
    return {
        "vs_undisturbed": _spread(ratios),
        "loss_to_readmitted_max_s": _spread(times),
        "deletions_never_readmitted": missing,
        "deletions_by_kind": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
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
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-elastic-workers-", dir=".rolloutrun") as tmp:
        work = Path(tmp).resolve()
        before = runtime_at(args.before, work / "before") if args.before else None
        here = runtime_here(work / "here")  # this tree, compiled: the pods' PYTHONPATH first
        inherited = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(here), *([inherited] if inherited else [])])
        if args.interleaved:  # one run per seed, U and D segments (the rate's measurement)
            from .elastic_workers_interleaved import interleaved_worker_seed

            per_seed = [
                interleaved_worker_seed(
                    seed, work, every=args.every, pairs=args.pairs, standby=args.standby
                )
                for seed in range(args.seeds)
            ]
        else:
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
                "settle_s": SETTLE_S,
                "stages": dict(WORKER_STAGES),
                "seeds": per_seed,
                "over_seeds": worker_over_seeds(per_seed),
                "load_average_1_5_15": {
                    "before": [round(x, 2) for x in load_before],
                    "after": [round(x, 2) for x in os.getloadavg()],
                },
                "minutes": round((time.time() - started) / 60, 1),
                "note": (
                    "one run per seed, undisturbed and disturbed segments in ABBA order"
                    if args.interleaved
                    else "arms run back to back in one process on a possibly shared machine"
                ),
            },
            indent=1,
        )
    )

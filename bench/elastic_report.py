"""Per deletion of ``bench/elastic.py``'s Gym arms: the stages from the deletion to the
replacement's first work, what became of each deletion, and the stats over them; with
``--paired``, the steps and the pods' CPU of each elastic arm around its deletions against
the undisturbed arm's at the same moments (where the rate goes).

Why a module of its own: the report is pure (:func:`deletion_report` takes the moments the
API polls and the pods' log lines gave) and tested alone, while ``bench/elastic.py`` runs
the arms; every deletion gets a report with its outcome, none is dropped for being
incomplete.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import LOGS_DIR, EmbeddedRun
from rolloutrun_runtime.contract.layout import TRACE_FILE

from .pod_cpu import pod_kind

READMITTED = "re-admitted at"
#: Log lines of the replacement's path to its first work (trainer and Gym logs).
READDRESSED = "replaced: generation"
GYM_LISTENING = "listening on"
#: The figures the Gym's "listening on" line carries (``gym_main.startup_cost``), as the
#: report names them: its process's CPU seconds, and the seconds since it was forked.
GYM_START_FIGURES = (("gym_start_cpu_s", " s CPU"), ("gym_start_wall_s", " s since"))
GYM_FIRST_RUN = ": first /run"
#: The stages of a replacement, in order, as the breakdown names them (the trainer reads the
#: replacement's address as soon as its pod runs, usually before it listens: that moment is
#: reported apart, as ``trainer_readdressed_after_s`` from the deletion).
STAGES = (
    ("old_pod_gone", "deleted -> old pod gone (its SIGTERM exit)"),
    ("new_pod_created", "old pod gone -> operator created the replacement"),
    ("pod_running", "created -> kubelet reports Running (process started)"),
    ("gym_listening", "Running -> Gym listening (imports, server build)"),
    ("trainer_readmitted", "Gym listening -> trainer's /healthz probe re-admitted it"),
    ("first_run", "re-admitted -> first /run on the replacement"),
)


class ReplacementWatch(threading.Thread):
    """From a deletion on: when the old pod was gone, and when its replacement (same name,
    a new uid) was first seen and first Running, on this process's clock, as the API's watch
    events arrive (the API's own timestamps have whole seconds).

    A watch, not polls: listing the pods every 50 ms cost this process ~0.1 core of CPU
    (the kubernetes client decoding every pod; the local cluster's API server, kubelet and
    operator share its interpreter) during the very replacement it timed, and in the
    elastic arms only; an event costs that once, and says when, not within 50 ms."""

    #: How long one deletion is followed.
    FOLLOW_S = 60.0

    def __init__(self, run: EmbeddedRun, victim: str, old_uid: str, at: float) -> None:
        super().__init__(daemon=True)
        self.embedded, self.victim, self.old_uid, self.at = run, victim, old_uid, at
        self.times: dict[str, float] = {}
        self.new_uid: str | None = None

    def seen(self, pod: Any, now: float, deleted: bool = False) -> None:
        """One state of the victim's name at ``now`` (``pod`` None or ``deleted``: none)."""
        uid = str(pod.metadata.uid) if pod is not None else None
        if deleted and uid == self.old_uid:
            uid = None
        if uid != self.old_uid:
            self.times.setdefault("old_pod_gone", now)
        if pod is not None and not deleted and uid != self.old_uid:
            self.new_uid = uid
            self.times.setdefault("new_pod_created", now)
            if pod.status is not None and pod.status.phase == "Running" and pod.status.pod_ip:
                self.times.setdefault("pod_running", now)

    def run(self) -> None:
        from kubernetes import watch

        core, namespace = self.embedded.core, self.embedded.namespace
        selector = f"metadata.name={self.victim}"
        while time.time() - self.at < self.FOLLOW_S and "pod_running" not in self.times:
            try:
                listed = core.list_namespaced_pod(namespace, field_selector=selector)
                self.seen(listed.items[0] if listed.items else None, time.time())
                follow = watch.Watch()
                stream = follow.stream(
                    core.list_namespaced_pod,
                    namespace,
                    field_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=max(int(self.FOLLOW_S - (time.time() - self.at)), 1),
                )
                for event in stream:
                    self.seen(event["object"], time.time(), event["type"] == "DELETED")
                    if "pod_running" in self.times:
                        break
                follow.stop()
            except Exception:  # a busy API server, an expired version: list again
                time.sleep(0.05)


def delete_watched(
    run: EmbeddedRun, pod: str, deletions: list[tuple[float, str]], watches: list[ReplacementWatch]
) -> bool:
    """Delete ``pod`` if its member serves: recorded in ``deletions``, its replacement
    followed by a started :class:`ReplacementWatch` in ``watches``; False: not serving."""
    serving = run.serving_member_uids()
    if pod not in serving:
        return False
    at = time.time()
    run.delete_pod(pod)
    deletions.append((at, pod))
    watches.append(ReplacementWatch(run, pod, serving[pod], at))
    watches[-1].start()
    return True


def _log_stamps(paths: list[Path], marker: str) -> list[float]:
    times = []
    for log in paths:
        for line in log.read_text(errors="replace").splitlines():
            if marker in line:
                try:
                    stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                except ValueError:
                    continue
                times.append(stamp.timestamp())
    return sorted(times)


#: Trainer log lines that show it noticed a lost Gym: an unreachable call, or the readdress.
TRAINER_NOTICED = ("is unreachable", READDRESSED)
#: The old Gym's log lines on SIGTERM (its pod deleted), and once its server is closed
#: (episodes in flight ended).
GYM_STOPPING = " stopping"
GYM_STOPPED = " stopped"
#: Moments reported from the deletion (not a stage: each runs beside the stages).
AFTER_DELETION = ("old_gym_stopping", "old_gym_stopped", "trainer_noticed", "trainer_readdressed")
#: What became of a deletion (:func:`deletion_report`).
OUTCOMES = ("doing work", "no work within the goal", "window ended first")
#: A replacement's first work within this many seconds of its deletion (issue 14's goal).
GOAL_DOING_WORK_S = 5.0


def _marker_times(run: EmbeddedRun, watch: ReplacementWatch) -> dict[str, float]:
    """Epoch times of one deletion's log lines (the first at or after it of each)."""
    cluster = run.work_dir / "cluster"
    old_logs = sorted(cluster.glob(f"pods/*/{watch.victim}-{watch.old_uid[:8]}/logs/*.log"))
    new_logs: list[Path] = []
    if watch.new_uid is not None:
        new_logs = sorted(cluster.glob(f"pods/*/{watch.victim}-{watch.new_uid[:8]}/logs/*.log"))
    trainer_logs = sorted(cluster.glob("pods/*/*-trainer-*/logs/trainer.log"))
    times: dict[str, float] = {}
    for key, paths, markers in (
        ("old_gym_stopping", old_logs, (GYM_STOPPING,)),
        ("old_gym_stopped", old_logs, (GYM_STOPPED,)),
        ("trainer_noticed", trainer_logs, TRAINER_NOTICED),
        ("gym_listening", new_logs, (GYM_LISTENING,)),
        ("trainer_readdressed", trainer_logs, (READDRESSED,)),
        ("trainer_readmitted", trainer_logs, (READMITTED,)),
        ("first_run", new_logs, (GYM_FIRST_RUN,)),
    ):
        found = [t for m in markers for t in _log_stamps(paths, m) if t >= watch.at - 0.5]
        if found:
            times[key] = min(found)
    return times


def gym_start_figures(line: str) -> dict[str, float]:
    """The start-up figures of a Gym's "listening on" line (pure; none from an older Gym's
    line, which has none): ``gym_listening`` is this CPU, or waiting for it on a busy node."""
    found = {}
    for key, unit in GYM_START_FIGURES:
        head, sep, _ = line.partition(unit)
        try:
            found[key] = float(head.rsplit(" ", 1)[-1]) if sep else None
        except ValueError:
            found[key] = None
    return {key: value for key, value in found.items() if value is not None}


def _gym_start(run: EmbeddedRun, watch: ReplacementWatch) -> dict[str, float]:
    """The replacement Gym's own start-up figures (its log's "listening on" line)."""
    if watch.new_uid is None:
        return {}
    cluster = run.work_dir / "cluster"
    for log in cluster.glob(f"pods/*/{watch.victim}-{watch.new_uid[:8]}/logs/*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if GYM_LISTENING in line:
                return gym_start_figures(line)
    return {}


def deletion_report(
    at: float, victim: str, times: dict[str, float], window_end: float
) -> dict[str, Any]:
    """What happened to one deletion (pure): seconds of each stage of :data:`STAGES` reached
    (each from the one before), when the old Gym got SIGTERM and when the trainer noticed
    (from the deletion), and its ``outcome``: ``doing work`` (the replacement's first
    ``/run``: ``total`` is from the deletion to it), ``no work within the goal`` (none by
    :data:`GOAL_DOING_WORK_S` after the deletion though the window went on past it: a miss),
    or ``window ended first`` (the window ended sooner: neither a hit nor a miss). The
    stage it got to is named, so no deletion is dropped from the report."""
    report: dict[str, Any] = {"victim": victim}
    previous, reached = at, None
    for key, _ in STAGES:
        if key not in times:
            break
        report[key] = round(times[key] - previous, 3)
        previous, reached = times[key], key
    report["reached"] = reached or "deleted"
    for key in AFTER_DELETION:
        if key in times:
            report[f"{key}_after_s"] = round(times[key] - at, 3)
    if reached == STAGES[-1][0]:
        report["total"] = round(previous - at, 3)
        report["outcome"] = "doing work"
    elif window_end - at >= GOAL_DOING_WORK_S:
        report["outcome"] = "no work within the goal"
    else:
        report["outcome"] = "window ended first"
    return report


#: The trainer's log line of each step it trained (``metrics.format_step_line``).
TRAINER_STEP = "trainer: step="
#: Seconds after (and before) each deletion over which the elastic arm's steps are counted
#: against the undisturbed arm's, trained at the same moments (``--paired``).
AROUND_DELETION_S = 6.0


def trainer_step_times(work_dir: Path) -> list[float]:
    """Epoch times of every step an arm's trainers logged (every incarnation)."""
    return _log_stamps(
        sorted((work_dir / "cluster").glob("pods/*/*-trainer-*/logs/trainer.log")), TRAINER_STEP
    )


def steps_around_deletions(
    deleted_at: list[float],
    elastic_steps: list[float],
    undisturbed_steps: list[float],
    window_s: float = AROUND_DELETION_S,
) -> dict[str, Any]:
    """Where a paired elastic arm's rate goes (pure): per deletion, the steps each arm
    trained in the ``window_s`` after it and in the ``window_s`` before it (the arms' own
    difference, with nothing deleted yet), and over the deletions the steps the elastic
    arm trained fewer after them (``lost_after``) and before them (``lost_before``). The
    arms run at the same time on one machine, so the undisturbed arm's count is the rate
    that moment's load allowed; the whole-window ratio mixes these losses with the arms'
    drift."""

    def count(steps: list[float], start: float, end: float) -> int:
        return sum(1 for t in steps if start <= t < end)

    per = _around(deleted_at, window_s, lambda lo, hi: {
        "elastic": count(elastic_steps, lo, hi), "undisturbed": count(undisturbed_steps, lo, hi)
    })  # fmt: skip
    return {
        "window_s": window_s,
        "per_deletion": per,
        "lost_after": sum(d["after"]["undisturbed"] - d["after"]["elastic"] for d in per),
        "lost_before": sum(d["before"]["undisturbed"] - d["before"]["elastic"] for d in per),
    }


#: Trace events counted around each deletion (:func:`rollouts_around_deletions`): the
#: rollouts an arm finished, and its groups dropped for zero reward variance (their
#: rollouts trained nothing: a step then needs more of them, as the policy learns).
ROLLOUT_EVENTS = ("attempt_sealed", "group_dropped")


def trace_times(work_dir: Path) -> dict[str, list[float]]:
    """Epoch times of each :data:`ROLLOUT_EVENTS` event in an arm's rollout trace."""
    times: dict[str, list[float]] = {event: [] for event in ROLLOUT_EVENTS}
    path = work_dir / LOGS_DIR / TRACE_FILE
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
                times[event["event"]].append(float(event["t"]))
            except (ValueError, KeyError, TypeError):
                continue  # another event, or a torn last line
    return times


def rollouts_around_deletions(
    deleted_at: list[float],
    elastic: dict[str, list[float]],
    undisturbed: dict[str, list[float]],
    window_s: float = AROUND_DELETION_S,
) -> dict[str, Any]:
    """As :func:`steps_around_deletions`, the rollouts each arm finished and the groups it
    dropped (:func:`trace_times`) after and before each deletion (pure). Steps mix the
    member loss (fewer rollouts done: ``rollouts_lost_after``) with the arms' diverging
    policies (more groups dropped: ``groups_dropped_extra_after``), which no member path
    causes; these two tell them apart."""

    def count(times: list[float], lo: float, hi: float) -> int:
        return sum(1 for t in times if lo <= t < hi)

    per = _around(deleted_at, window_s, lambda lo, hi: {
        event: {"elastic": count(elastic.get(event, []), lo, hi),
                "undisturbed": count(undisturbed.get(event, []), lo, hi)}
        for event in ROLLOUT_EVENTS
    })  # fmt: skip

    def gap(side: str, event: str) -> int:
        return sum(d[side][event]["undisturbed"] - d[side][event]["elastic"] for d in per)

    return {
        "window_s": window_s,
        "per_deletion": per,
        "rollouts_lost_after": gap("after", "attempt_sealed"),
        "rollouts_lost_before": gap("before", "attempt_sealed"),
        "groups_dropped_extra_after": -gap("after", "group_dropped"),
        "groups_dropped_extra_before": -gap("before", "group_dropped"),
    }


def dispatch_times(work_dir: Path) -> list[tuple[float, str]]:
    """Each attempt's dispatch in an arm's rollout trace: (epoch time, Gym instance id)."""
    path = work_dir / LOGS_DIR / TRACE_FILE
    found: list[tuple[float, str]] = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
            if event["event"] == "attempt_dispatched":
                found.append((float(event["t"]), str(event["gym_instance_id"])))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line
    return found


def standby_work(
    dispatches: list[tuple[float, str]],
    standbys: set[str],
    deleted_at: list[float],
    until: float = float("inf"),
) -> dict[str, Any]:
    """When the standby Gyms (``spec.gym.standby``, their instance ids) were handed work
    until ``until`` (the window's end: the arm's teardown stops every Gym) (pure): their
    dispatches before the first deletion (0 when only a loss moves work to them) and in
    all, and per deletion the seconds to the first one after it (None: none before the
    next deletion or ``until``)."""
    times = sorted(t for t, gym in dispatches if gym in standbys and t < until)
    losses = sorted(deleted_at)
    first_loss = losses[0] if losses else float("inf")
    first_after = [
        next((round(t - at, 3) for t in times if at <= t < end), None)
        for at, end in zip(losses, [*losses[1:], float("inf")], strict=False)
    ]
    return {
        "dispatches_to_standby": len(times),
        "before_first_loss": sum(1 for t in times if t < first_loss),
        "loss_to_first_standby_dispatch_s": first_after,
    }


def arm_standby_work(work_dir: Path, standby: int, arm: dict[str, Any]) -> dict[str, Any]:
    """:func:`standby_work` of an arm of the ``bench`` run with ``standby`` standby Gyms
    (indices 2..), over its window (``_window``'s ``deleted_at`` and ``window_end``)."""
    ids = {f"bench-gym-{2 + i}" for i in range(standby)}
    return standby_work(dispatch_times(work_dir), ids, arm["deleted_at"], arm["window_end"])


def _around(
    deleted_at: list[float], window_s: float, tally: Callable[[float, float], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per deletion, ``tally`` over the ``window_s`` after it and the ``window_s`` before."""
    return [
        {
            side: tally(start, start + window_s)
            for side, start in (("after", at), ("before", at - window_s))
        }
        for at in deleted_at
    ]


#: The pods whose CPU :func:`cpu_around_deletions` compares between the paired arms.
CPU_ROLES = ("trainer", "gym")


def cpu_around_deletions(
    deleted_at: list[float],
    elastic_cpu: list[list[Any]],
    undisturbed_cpu: list[list[Any]],
    window_s: float = AROUND_DELETION_S,
) -> dict[str, Any]:
    """Where a paired elastic arm's CPU goes around each deletion (pure), as
    :func:`steps_around_deletions` counts its steps: per deletion and per role
    (:data:`CPU_ROLES`; the old, the surviving and the replacement Gym pods are all
    ``gym``) the CPU-seconds each arm's pods spent in the ``window_s`` after it and before
    it, from rows ``(time, role, cpu_s)`` (:func:`pod_cpu_rows`). On one node every pod draws
    on the node's CPU share, so the trainer's CPU the elastic arm lacks after a deletion
    (``trainer_cpu_lost_after_s``) beside the Gyms' extra (``gym_cpu_extra_after_s``: the
    replacement's start, the survivor's extra episodes) says whether its steps were lost to
    CPU taken by the replacement rather than to a wait."""

    def spent(rows: list[list[Any]], role: str, lo: float, hi: float) -> float:
        return sum((float(cpu) for t, kind, cpu in rows if kind == role and lo <= t < hi), 0.0)

    per = _around(deleted_at, window_s, lambda lo, hi: {
        role: {"elastic": round(spent(elastic_cpu, role, lo, hi), 2),
               "undisturbed": round(spent(undisturbed_cpu, role, lo, hi), 2)}
        for role in CPU_ROLES
    })  # fmt: skip

    def gap(side: str, role: str) -> float:
        return round(sum(d[side][role]["undisturbed"] - d[side][role]["elastic"] for d in per), 2)

    return {
        "window_s": window_s,
        "per_deletion": per,
        "trainer_cpu_lost_after_s": gap("after", "trainer"),
        "trainer_cpu_lost_before_s": gap("before", "trainer"),
        "gym_cpu_extra_after_s": 0.0 - gap("after", "gym"),
        "gym_cpu_extra_before_s": 0.0 - gap("before", "gym"),
    }


def pod_cpu_rows(rows: list[tuple[float, str, float]], names: dict[str, str]) -> list[list[Any]]:
    """A :class:`bench.pod_cpu.PodCpuSampler`'s rows as ``[time, role, cpu_s]`` of the pods
    of :data:`CPU_ROLES` (:func:`bench.pod_cpu.pod_kind`, by name: a replacement has its
    old pod's name), compact for a paired arm's answer."""
    out = []
    for t, uid, cpu in rows:
        role = pod_kind(names.get(uid, uid), uid, victim="", refill=None)
        if role in CPU_ROLES:
            out.append([round(t, 3), role, round(cpu, 4)])
    return out


def _breakdown_stats(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: p50 and max over the replacements (and the total, the moments from the
    deletion, and the replacement Gym's own start-up figures)."""
    keys = [key for key, _ in STAGES] + ["total", *(f"{k}_after_s" for k in AFTER_DELETION)]
    keys += [key for key, _ in GYM_START_FIGURES]
    return {key: _stats([sample[key] for sample in samples if key in sample]) for key in keys}


def _stats(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50": round(statistics.median(samples), 2),
        "max": round(max(samples), 2),
    }


def over_seeds(per_seed: list[dict[str, Any]], arm: str = "elastic") -> dict[str, Any]:
    """Mean, spread and worst seed of the ``arm``/undisturbed ratio and of the replacement
    time (loss -> first /run, each seed's max), with the goals checked on the worst seed:
    a deletion whose replacement did no work within the goal (:func:`deletion_report`)
    fails the time goal, as a slow one does. Where the time went: each stage's p50 and max
    over every deletion of every seed (the largest stage is the one to cut)."""
    ratios = [s[f"{arm}_vs_undisturbed"] for s in per_seed]
    recovery = [s[arm]["loss_to_first_run_s"].get("max") for s in per_seed]
    missed = [int((s[arm].get("outcomes") or {}).get(OUTCOMES[1], 0)) for s in per_seed]
    worst_rate = min(range(len(per_seed)), key=lambda i: ratios[i])
    times = [t for t in recovery if t is not None]
    worst_time = max(range(len(per_seed)), key=lambda i: (missed[i], recovery[i] or 0.0))
    deletions = [r for s in per_seed for r in s[arm].get("per_deletion") or []]
    return {
        "elastic_vs_undisturbed": _spread(ratios),
        "loss_to_first_run_max_s": _spread(times),
        "breakdown_s (every deletion of every seed)": _breakdown_stats(deletions),
        "deletions_without_work_within_goal": sum(missed),
        "worst_seed_rate": per_seed[worst_rate]["seed"],
        "worst_seed_replacement": per_seed[worst_time]["seed"],
        "goals_on_worst_seed": {
            "rate >= 0.90 of undisturbed": ratios[worst_rate] >= 0.9,
            "loss -> first work <= 5 s (max)": bool(times)
            and max(times) <= GOAL_DOING_WORK_S
            and not any(missed),
        },
    }


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 3),
        "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def abba_pairs(pairs: int) -> list[tuple[str, str]]:
    """``pairs`` U/D segment pairs in ABBA order (U D, D U, U D, ...): a linear drift of the
    machine or the run favours neither side."""
    return [("U", "D") if i % 2 == 0 else ("D", "U") for i in range(pairs)]


def interleaved_rates(segments: list[tuple[str, int, float]]) -> dict[str, Any]:
    """Steps per minute of the U and D segments, their ratio (D over U, all segments
    pooled), and the ratio of each U/D pair (segments 2i and 2i+1)."""

    def rate(kind: str, chosen: list[tuple[str, int, float]]) -> float:
        steps = sum(n for k, n, _ in chosen if k == kind)
        seconds = sum(t for k, _, t in chosen if k == kind)
        return steps / seconds * 60 if seconds else 0.0

    undisturbed, disturbed = rate("U", segments), rate("D", segments)
    pairs = [segments[i : i + 2] for i in range(0, len(segments) - 1, 2)]
    per_pair = [rate("D", p) / rate("U", p) for p in pairs if rate("U", p)]
    return {
        "undisturbed": {"steps_per_min": round(undisturbed, 2)},
        "disturbed_steps_per_min": round(disturbed, 2),
        "elastic_vs_undisturbed": round(disturbed / undisturbed, 3) if undisturbed else 0.0,
        "per_pair_ratio": [round(r, 3) for r in per_pair],
        "segments": [{"kind": k, "steps": n, "s": round(t, 1)} for k, n, t in segments],
    }

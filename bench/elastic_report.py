"""Per deletion of ``bench/elastic.py``'s Gym arms: the stages from the deletion to the
replacement's first work, what became of each deletion, and the stats over them.

Why a module of its own: the report is pure (:func:`deletion_report` takes the moments the
API polls and the pods' log lines gave) and tested alone, while ``bench/elastic.py`` runs
the arms; every deletion gets a report with its outcome, none is dropped for being
incomplete.
"""

from __future__ import annotations

import datetime as dt
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun

READMITTED = "re-admitted at"
#: Log lines of the replacement's path to its first work (trainer and Gym logs).
READDRESSED = "replaced: generation"
GYM_LISTENING = "listening on"
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
    a new uid) was first seen and first Running, on this process's clock (polls of the API
    every 50 ms; the API's own timestamps have whole seconds)."""

    def __init__(self, run: EmbeddedRun, victim: str, old_uid: str, at: float) -> None:
        super().__init__(daemon=True)
        self.embedded, self.victim, self.old_uid, self.at = run, victim, old_uid, at
        self.times: dict[str, float] = {}
        self.new_uid: str | None = None

    def run(self) -> None:
        while time.time() - self.at < 60 and "pod_running" not in self.times:
            try:
                pod = self.embedded.pods().get(self.victim)
            except Exception:  # a busy API server: try again
                time.sleep(0.05)
                continue
            now = time.time()
            uid = str(pod.metadata.uid) if pod is not None else None
            if uid != self.old_uid:
                self.times.setdefault("old_pod_gone", now)
            if pod is not None and uid != self.old_uid:
                self.new_uid = uid
                self.times.setdefault("new_pod_created", now)
                if pod.status.phase == "Running" and pod.status.pod_ip:
                    self.times["pod_running"] = now
            time.sleep(0.05)


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

    per = []
    for at in deleted_at:
        per.append({
            side: {"elastic": count(elastic_steps, start, start + window_s),
                   "undisturbed": count(undisturbed_steps, start, start + window_s)}
            for side, start in (("after", at), ("before", at - window_s))
        })  # fmt: skip
    return {
        "window_s": window_s,
        "per_deletion": per,
        "lost_after": sum(d["after"]["undisturbed"] - d["after"]["elastic"] for d in per),
        "lost_before": sum(d["before"]["undisturbed"] - d["before"]["elastic"] for d in per),
    }


def _breakdown_stats(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: p50 and max over the replacements (and the total)."""
    keys = [key for key, _ in STAGES] + ["total", *(f"{k}_after_s" for k in AFTER_DELETION)]
    return {key: _stats([sample[key] for sample in samples if key in sample]) for key in keys}


def _stats(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50": round(statistics.median(samples), 2),
        "max": round(max(samples), 2),
    }

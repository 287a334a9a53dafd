"""What each kill cost, from the run's trace: thrown-away time, rollout work lost, restore.

Why pure functions over trace events: the numbers a campaign reports per kill (see the
package doc) must be checkable against hand-written traces, and they are computed after
every process is gone, from ``rollout_trace.jsonl`` alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutrun_runtime.contract.layout import STEP_ENTRY


@dataclasses.dataclass
class Kill:
    """One SIGKILL of the trainer."""

    index: int
    how: str  # "random-step", "random-startup", "planned" or "site"
    site: str | None
    hit: int | None
    steps_before: int
    steps_at_kill: int
    killed_at: float
    incarnation_s: float
    thrown_away_s: float = 0.0
    rollout_work_lost_s: float = 0.0
    #: The trace analyzer's lost progress against the uninterrupted reference run (None
    #: without one): how much later the groups running at the kill were sealed.
    lost_progress_s: float | None = None
    restored_from: str | None = None
    restored_snapshot_id: int | None = None


def restore_cut_times(events: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Per run id: the wall time of the state it resumed from (None for a fresh start).

    A snapshot resume records its ``cut_time``; a trainer-checkpoint resume
    (``resumed_from`` ending in ``step_<N>``) continues from the moment step N completed.
    """
    cuts: dict[str, float | None] = {}
    completed: dict[int, float] = {}
    for event in events:
        if event["event"] == "step_completed":
            completed[int(event["step"])] = float(event["t"])
        elif event["event"] == "run_started":
            cut = event.get("cut_time")
            source = event.get("resumed_from") or ""
            entry = STEP_ENTRY.match(source.rstrip("/").rsplit("/", 1)[-1])
            if cut is None and entry:
                cut = completed.get(int(entry.group(1)))
            cuts[event["run_id"]] = None if cut is None else float(cut)
    return cuts


def rollout_work_lost(
    stopped: Sequence[Mapping[str, Any]],
    resumed: Sequence[Mapping[str, Any]],
    cut_time: float | None,
) -> float:
    """Rollout seconds of the stopped incarnation that the resumed one cannot keep.

    Every attempt's time after the restored cut is lost (the restored state never saw it);
    an attempt in flight at the cut and abandoned at the restart loses its time before the
    cut too. ``cut_time`` None (a fresh start) loses everything.

    An attempt restored at its turn (``attempt_restored``) may continue from the Gym
    replica's own newer state, or hand back the result it finished with after the cut: what
    the resumed run redoes is at most its time from redispatch to seal there. So its loss is
    the smaller of its time after the cut and that (no credit unless the resumed run sealed
    it: a later kill counts what it did not finish).
    """
    if not stopped:
        return 0.0
    stop = float(stopped[-1]["t"])
    cut = float("-inf") if cut_time is None else cut_time
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    for event in stopped:
        uuid = event.get("attempt_uuid")
        if uuid is None:
            continue
        if event["event"] == "attempt_dispatched":
            starts[uuid] = float(event["t"])
        elif event["event"] in ("attempt_sealed", "attempt_failed") and uuid in starts:
            ends[uuid] = float(event["t"])
    abandoned = {
        e["attempt_uuid"]
        for e in resumed
        if e["event"] == "attempt_abandoned" and e.get("reason") == "restart"
    }
    redone = _redone_after_restore(resumed)
    lost = 0.0
    for uuid, start in starts.items():
        end = ends.get(uuid, stop)
        after_cut = max(0.0, end - max(start, cut))
        lost += min(after_cut, redone.get(uuid, after_cut))
        if uuid in abandoned and start < cut:
            lost += cut - start
    return lost


def _redone_after_restore(resumed: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per attempt the resumed run restored at its turn and sealed: redispatch to seal."""
    restored = {e["attempt_uuid"] for e in resumed if e["event"] == "attempt_restored"}
    dispatched: dict[str, float] = {}
    redone: dict[str, float] = {}
    for event in resumed:
        uuid = event.get("attempt_uuid")
        if uuid is None or uuid not in restored:
            continue
        if event["event"] == "attempt_dispatched":
            dispatched.setdefault(uuid, float(event["t"]))
        elif event["event"] == "attempt_sealed" and uuid in dispatched:
            redone[uuid] = float(event["t"]) - dispatched[uuid]
    return redone


def attribute_stops(
    kills: list[Kill],
    events: list[dict[str, Any]],
    baseline: list[dict[str, Any]] | None = None,
) -> None:
    """Fill each kill's thrown-away time, lost work, lost progress (against ``baseline``,
    an uninterrupted run's trace) and restore source from the trace."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import analyze

    events = sorted(events, key=lambda e: e["t"])
    report = analyze(events, baseline)
    cuts = restore_cut_times(events)
    by_run: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        by_run.setdefault(event["run_id"], []).append(event)
    for stop in report.stops:
        after = by_run[stop.resumed_run_id]
        started = next((e for e in after if e["event"] == "run_started"), {})
        # The kill this stop belongs to: the last one before the resumed run began.
        owners = [k for k in kills if k.killed_at <= stop.resume_time]
        if not owners:
            continue
        kill = owners[-1]
        kill.thrown_away_s = stop.thrown_away_s
        kill.lost_progress_s = stop.lost_progress_s
        kill.rollout_work_lost_s = rollout_work_lost(
            by_run[stop.stopped_run_id], after, cuts.get(stop.resumed_run_id)
        )
        kill.restored_from = started.get("resumed_from")
        kill.restored_snapshot_id = started.get("snapshot_id")

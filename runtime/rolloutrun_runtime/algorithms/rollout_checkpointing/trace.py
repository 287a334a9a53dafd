"""The rollout trace: one JSON line per event, and the analyzer that reads it back.

Metrics are averages; the trace lets a person check a stop and restore rollout by rollout.
Each line is ``{"t": wall time, "run_id": new per process, "event": name, ...fields}``. The
writer flushes every line, so a run killed with SIGKILL loses only the line being written
(the analyzer ignores a torn last line).

Rows match across runs by ``prompt_id`` and ``generation_index``; group and attempt ids are
new in every run. Per stop (a change of ``run_id``), the analyzer reports:

* **thrown-away time**: for each attempt abandoned with reason ``restart``, the time from its
  last ``attempt_dispatched`` to the restored snapshot's ``cut_time`` — work the snapshot had
  seen in flight but could not keep;
* **lost progress** (with a baseline trace of a run that never stopped): how much later the
  groups running at the stop reached ``group_sealed`` than the same prompts in the baseline;
* **batch age** per step: the token-weighted number of policy updates between generating a
  token and training on it, from ``group_trained`` events' per-version token counts.

``rolloutrun trace LOG_DIR|STORAGE_URI|--run NAME [--json] [--plot FILE.png] [--baseline
TRACE]`` prints it; from a storage URI or a RolloutRun it reads every incarnation's trace
segments from the run's storage (:mod:`rolloutrun_runtime.run_logs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rolloutrun_runtime.contract.layout import TRACE_FILE

log = logging.getLogger(__name__)

#: Every event the runtime writes, with the fields it carries (besides t, run_id, event).
EVENTS: dict[str, tuple[str, ...]] = {
    "run_started": ("incarnation", "resumed_from", "snapshot_id", "cut_time"),
    # An environment server without the checkpoint control plane: turn became sibling.
    "recovery_level_lowered": ("requested", "level", "reason"),
    "restore_refused": ("entry", "reason"),
    # The environment refused a turn-level restore: one episode (it restarts from turn 0),
    # or the whole restore (rollout_id and instance_id None: every episode restarts).
    "environment_restore_refused": ("snapshot_id", "rollout_id", "instance_id", "reason"),
    "group_reserved": ("group_id", "prompt_id", "target_step"),
    "attempt_dispatched": (
        "group_id",
        "prompt_id",
        "generation_index",
        "attempt_uuid",
        "gym_instance_id",
        "gym_attempt",
    ),
    "attempt_sealed": ("group_id", "prompt_id", "generation_index", "attempt_uuid"),
    "attempt_failed": ("group_id", "prompt_id", "generation_index", "attempt_uuid", "reason"),
    "attempt_abandoned": ("group_id", "prompt_id", "generation_index", "attempt_uuid", "reason"),
    "attempt_restored": ("group_id", "prompt_id", "generation_index", "attempt_uuid", "level"),
    "group_sealed": ("group_id", "prompt_id"),
    "group_dropped": ("group_id", "prompt_id", "reason"),
    "group_trained": ("group_id", "prompt_id", "step", "tokens_by_version"),
    "step_completed": ("step", "weight_version", "groups", "batch_age"),
    "snapshot_published": (
        "snapshot_id",
        "anchor",
        "cut_time",
        "manifest_uri",
        "outcome",
        "env_unavailable",
    ),
    "snapshot_skipped": ("reason",),
    "restore_completed": (
        "snapshot_id",
        "cut_time",
        "groups",
        "redispatched",
        "startup",
        "dynamo_imported",
    ),
    "preemption_notice": ("deadline",),
}


class TraceWriter:
    """Appends events to ``rollout_trace.jsonl``; safe to call from several threads."""

    def __init__(self, path: Path | None, run_id: str | None = None) -> None:
        self.path = path
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._handle: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = path.open("a", encoding="utf-8")

    @property
    def enabled(self) -> bool:
        return self._handle is not None

    def emit(self, event: str, **fields: Any) -> None:
        if self._handle is None:
            return
        if event not in EVENTS:
            raise ValueError(f"unknown trace event {event!r}; add it to trace.EVENTS")
        line = json.dumps(
            {"t": time.time(), "run_id": self.run_id, "event": event, **fields},
            separators=(",", ":"),
            default=str,
        )
        with self._lock:
            self._handle.write(line + "\n")
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Events from a trace file; a torn or corrupt line is skipped with a warning."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: skipping a torn line", path, number)
                continue
            if isinstance(event, dict) and "event" in event and "t" in event:
                yield event


# --------------------------------------------------------------------------- analysis
@dataclasses.dataclass
class StopReport:
    """What one stop (one process ending and the next resuming) cost."""

    index: int
    stopped_run_id: str
    resumed_run_id: str
    stop_time: float
    resume_time: float
    restored_snapshot_id: int | None
    cut_time: float | None
    abandoned_attempts: int
    thrown_away_s: float
    restored_attempts: int
    lost_progress_s: float | None
    #: Attempts the stopped run had dispatched and not yet sealed or failed when it stopped.
    in_flight_at_stop: int = 0
    #: Seconds from the restored cut to the stop (None: a fresh start).
    since_cut_s: float | None = None


@dataclasses.dataclass
class TraceReport:
    runs: list[str]
    stops: list[StopReport]
    batch_age: dict[int, float]
    snapshots: int
    groups_trained: int

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "stops": [dataclasses.asdict(stop) for stop in self.stops],
            "batch_age": {str(step): age for step, age in sorted(self.batch_age.items())},
            "snapshots": self.snapshots,
            "groups_trained": self.groups_trained,
            "thrown_away_s_total": sum(stop.thrown_away_s for stop in self.stops),
        }


def batch_age_by_step(events: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Token-weighted policy-update lag between generating and training, per step.

    A group trained at step ``s`` by weights of version ``s - 1`` whose tokens came from
    version ``v`` has age ``(s - 1) - v`` for those tokens.
    """
    totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in events:
        if event.get("event") != "group_trained":
            continue
        step = int(event["step"])
        for version, count in (event.get("tokens_by_version") or {}).items():
            totals[step][0] += max(0, (step - 1) - int(version)) * float(count)
            totals[step][1] += float(count)
    return {step: (num / den if den else 0.0) for step, (num, den) in sorted(totals.items())}


def _prompt_key(event: Mapping[str, Any]) -> tuple[int, int]:
    """A prompt across runs: its dataset index and epoch (traces before epochs: epoch 0)."""
    return int(event["prompt_id"]), int(event.get("epoch") or 0)


def _sealed_offsets(events: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], float]:
    """Seconds from the trace's first event to each prompt's group_sealed."""
    if not events:
        return {}
    start = events[0]["t"]
    return {
        _prompt_key(event): event["t"] - start
        for event in events
        if event.get("event") == "group_sealed"
    }


def analyze(
    events: list[dict[str, Any]], baseline: list[dict[str, Any]] | None = None
) -> TraceReport:
    """Per-stop costs, batch age and totals from one run's (possibly resumed) trace."""
    events = sorted(events, key=lambda event: event["t"])
    runs = list(dict.fromkeys(event["run_id"] for event in events))
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_run[event["run_id"]].append(event)
    baseline_sealed = _sealed_offsets(baseline or [])
    stops = []
    for index, (before, after) in enumerate(itertools.pairwise(runs)):
        stops.append(_stop_report(index, by_run[before], by_run[after], baseline_sealed, events))
    return TraceReport(
        runs=runs,
        stops=stops,
        batch_age=batch_age_by_step(events),
        snapshots=sum(1 for e in events if e["event"] == "snapshot_published"),
        groups_trained=sum(1 for e in events if e["event"] == "group_trained"),
    )


def _stop_report(
    index: int,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    baseline_sealed: dict[tuple[int, int], float],
    all_events: list[dict[str, Any]],
) -> StopReport:
    started = next((e for e in after if e["event"] == "run_started"), after[0])
    cut_time = started.get("cut_time")
    last_dispatch: dict[str, float] = {}
    ended: set[str] = set()
    for event in before:
        if event["event"] == "attempt_dispatched":
            last_dispatch[event["attempt_uuid"]] = event["t"]
        elif event["event"] in ("attempt_sealed", "attempt_failed"):
            ended.add(event["attempt_uuid"])
    abandoned = [
        e for e in after if e["event"] == "attempt_abandoned" and e.get("reason") == "restart"
    ]
    thrown = 0.0
    for event in abandoned:
        dispatched = last_dispatch.get(event["attempt_uuid"])
        if dispatched is not None and cut_time is not None:
            thrown += max(0.0, float(cut_time) - dispatched)
    lost = None
    if baseline_sealed:
        origin = all_events[0]["t"]
        running = {_prompt_key(e) for e in before if e["event"] == "attempt_dispatched"} - {
            _prompt_key(e) for e in before if e["event"] == "group_sealed"
        }
        delays = [
            (e["t"] - origin) - baseline_sealed[_prompt_key(e)]
            for e in after
            if e["event"] == "group_sealed"
            and _prompt_key(e) in running
            and _prompt_key(e) in baseline_sealed
        ]
        lost = math.fsum(delays) / len(delays) if delays else 0.0  # = statistics.fmean
    return StopReport(
        index=index,
        stopped_run_id=before[0]["run_id"],
        resumed_run_id=after[0]["run_id"],
        stop_time=before[-1]["t"],
        resume_time=after[0]["t"],
        restored_snapshot_id=started.get("snapshot_id"),
        cut_time=cut_time,
        abandoned_attempts=len(abandoned),
        thrown_away_s=thrown,
        restored_attempts=sum(
            1 for e in after if e["event"] == "attempt_restored" and e.get("level") != "member"
        ),
        lost_progress_s=lost,
        in_flight_at_stop=len(set(last_dispatch) - ended),
        since_cut_s=None if cut_time is None else before[-1]["t"] - float(cut_time),
    )


# --------------------------------------------------------------------------- plot
def plot_attempts(events: list[dict[str, Any]], out: Path) -> None:
    """One row per rollout slot (prompt, generation): attempts as bars; snapshots,
    stops and restores as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = sorted(events, key=lambda event: event["t"])
    origin = events[0]["t"] if events else 0.0
    starts: dict[str, tuple[tuple[int, int], float]] = {}
    bars: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    colors = {
        "attempt_sealed": "tab:green",
        "attempt_failed": "tab:red",
        "attempt_abandoned": "tab:orange",
    }
    for event in events:
        name = event["event"]
        if name == "attempt_dispatched":
            slot = (int(event["prompt_id"]), int(event["generation_index"]))
            starts[event["attempt_uuid"]] = (slot, event["t"] - origin)
        elif name in colors and event.get("attempt_uuid") in starts:
            slot, begin = starts.pop(event["attempt_uuid"])
            bars[slot].append((begin, event["t"] - origin - begin, colors[name]))
    slots = sorted(bars)
    height = max(3.0, min(40.0, 0.12 * len(slots) + 1.5))
    figure, axes = plt.subplots(figsize=(12, height))
    for row, slot in enumerate(slots):
        for begin, width, color in bars[slot]:
            axes.broken_barh([(begin, max(width, 1e-3))], (row - 0.4, 0.8), color=color)
    marks = {
        "snapshot_published": ("tab:blue", "snapshot"),
        "run_started": ("black", "start/restore"),
        "preemption_notice": ("tab:purple", "preemption"),
    }
    seen = set()
    for event in events:
        if event["event"] in marks:
            color, label = marks[event["event"]]
            axes.axvline(
                event["t"] - origin,
                color=color,
                linewidth=0.8,
                linestyle="--",
                label=None if label in seen else label,
            )
            seen.add(label)
    last_seen: dict[str, float] = {}
    for event in events:
        last_seen[event["run_id"]] = event["t"]
    for stop in list(last_seen.values())[:-1]:  # every run but the last was stopped
        axes.axvline(
            stop - origin,
            color="tab:red",
            linewidth=1.5,
            label=None if "stop" in seen else "stop (last event before a kill)",
        )
        seen.add("stop")
    axes.set_xlabel("seconds since the first event")
    axes.set_ylabel("rollout slot (prompt, generation)")
    axes.set_title("Rollout attempts: green sealed, orange abandoned, red failed")
    if seen:
        axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


# --------------------------------------------------------------------------- CLI
def _find_trace(path: Path) -> Path:
    candidate = path / TRACE_FILE if path.is_dir() else path
    if not candidate.is_file():
        raise FileNotFoundError(f"{candidate}: no rollout trace (set checkpointing.trace: true)")
    return candidate


def _render_text(report: TraceReport) -> str:
    lines = [
        f"runs: {len(report.runs)}, stops: {len(report.stops)}, "
        f"snapshots: {report.snapshots}, groups trained: {report.groups_trained}"
    ]
    for stop in report.stops:
        lost = "n/a" if stop.lost_progress_s is None else f"{stop.lost_progress_s:.2f}s"
        lines.append(
            f"stop {stop.index}: restored snapshot {stop.restored_snapshot_id}, "
            f"{stop.abandoned_attempts} attempts abandoned, thrown away "
            f"{stop.thrown_away_s:.2f}s, {stop.restored_attempts} restored, lost progress {lost}, "
            f"{stop.in_flight_at_stop} in flight at the stop, "
            + (
                "fresh start"
                if stop.since_cut_s is None
                else f"cut {stop.since_cut_s:.2f}s before it"
            )
        )
    if any(stop.lost_progress_s is None for stop in report.stops):
        lines.append("lost progress needs --baseline LOG_DIR (an uninterrupted run's trace)")
    if report.batch_age:
        ages = ", ".join(f"{step}:{age:.2f}" for step, age in report.batch_age.items())
        lines.append(f"batch age by step: {ages}")
    return "\n".join(lines)


def _stored_events(storage_uri: str) -> list[dict[str, Any]]:
    """Every incarnation's trace from the run's storage (``run_logs/trace/``), in order."""
    from rolloutrun_runtime.contract.layout import TRACE_LOG
    from rolloutrun_runtime.run_logs import read_log_lines
    from rolloutrun_runtime.storage import StorageError, open_storage

    try:
        lines = read_log_lines(open_storage(storage_uri), TRACE_LOG)
    except (StorageError, ValueError) as error:
        raise FileNotFoundError(f"{storage_uri}: cannot read the rollout trace: {error}") from error
    events = []
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s trace line %d: skipping a torn line", storage_uri, number)
            continue
        if isinstance(event, dict) and "event" in event and "t" in event:
            events.append(event)
    if not events:
        raise FileNotFoundError(
            f"{storage_uri}: no rollout trace in the run's storage (set checkpointing.trace: true)"
        )
    return events


def _events_of(target: str) -> list[dict[str, Any]]:
    """A trace from a log directory, a trace file or a storage URI."""
    from rolloutrun_runtime.run_lookup import is_storage_uri

    if is_storage_uri(target):
        return _stored_events(target)
    return list(read_events(_find_trace(Path(target))))


def _run_trace(args: argparse.Namespace) -> int:
    from rolloutrun_runtime.run_lookup import RunLookupError, resolve_target

    try:
        if args.run is not None or args.target is None:
            events = _stored_events(resolve_target(args).storage_uri)
        else:
            events = _events_of(args.target)
        baseline = _events_of(args.baseline) if args.baseline else None
    except (FileNotFoundError, RunLookupError) as error:
        print(f"rolloutrun trace: {error}")
        return 2
    report = analyze(events, baseline)
    if args.plot:
        plot_attempts(events, Path(args.plot))
    print(json.dumps(report.to_json(), indent=1) if args.json else _render_text(report))
    return 0


def register_cli(parser: argparse.ArgumentParser) -> None:
    """Analyze a rollout trace: per-stop thrown-away time, lost progress, batch age."""
    from rolloutrun_runtime.run_lookup import add_target_arguments

    add_target_arguments(parser, "the trace: a run's log dir (or its rollout_trace.jsonl)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw each slot's attempts")
    parser.add_argument(
        "--baseline",
        metavar="LOG_DIR|URI",
        help="an uninterrupted run's trace (log dir, file or storage URI), for lost progress",
    )
    parser.set_defaults(handler=_run_trace)

"""Per-step training metrics: one JSON line per train step in ``<logDir>/metrics.jsonl``.

Why JSON lines: a killed run loses at most the line being written, every line stands alone
for ``jq``/pandas, and the learning test and the benchmark read the same file the user
watches. Each write is flushed so a ``tail -f`` sees steps as they finish.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# FINAL_WEIGHTS_FILE stays importable from here for the trainer that writes it.
from rolloutrun_runtime.contract.layout import FINAL_WEIGHTS_FILE as FINAL_WEIGHTS_FILE
from rolloutrun_runtime.contract.layout import METRICS_FILE

#: Keys every step line has (the issue's contract with users and tests).
REQUIRED_KEYS = (
    "step",
    "reward_mean",
    "loss",
    "step_time_s",
    "tokens_per_s",
    "groups",
    "batch_age",
)


class OverheadClock:
    """Accumulates wall time spent in the controller's own bookkeeping."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started: float | None = None

    def __enter__(self) -> OverheadClock:
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None

    def take(self) -> float:
        """The time accumulated since the last ``take``."""
        total, self.total_s = self.total_s, 0.0
        return total


@dataclass
class EnvironmentRestoreMetrics:
    """How this incarnation's turn-level restore went, in every step record.

    Why in the metrics: a refused restore costs every refused episode its turns (it restarts
    from turn 0), which a warning in the log hides; ``env_restore_refused_episodes`` counts
    the episodes the environment refused and ``env_restore_failed`` is 1 when it refused the
    whole restore. Both stay 0 for a fresh run or a restore that kept every episode.
    """

    refused_episodes: int = 0
    failed: bool = False

    def as_record(self) -> dict[str, int]:
        return {
            "env_restore_refused_episodes": self.refused_episodes,
            "env_restore_failed": int(self.failed),
        }


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends step records to ``metrics.jsonl`` in a log directory."""

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=True)
        with self.path.open("a") as handle:
            handle.write(line + "\n")
            handle.flush()


def read_metrics(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every step record of a run, in order."""
    path = Path(log_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_progress(record: Mapping[str, Any], max_steps: int) -> str:
    """One terminal line for a step record."""
    return (
        f"step {record['step']:>4}/{max_steps}  reward {record['reward_mean']:.3f}  "
        f"loss {record['loss']:+.4f}  groups {record['groups']:>3}  "
        f"{record['tokens_per_s']:.0f} tok/s  age {record['batch_age']:.2f}  "
        f"{record['step_time_s']:.2f}s"
    )


def format_step_line(
    record: Mapping[str, Any], max_steps: int, snapshot_age_s: float | None
) -> str:
    """The trainer pod's log line for a step (``kubectl logs``): ``key=value`` fields."""
    age = "none" if snapshot_age_s is None else f"{snapshot_age_s:.1f}s"
    reward, loss = _clean(record["reward_mean"]), _clean(record["loss"])
    return (
        f"step={record['step']}/{max_steps} "
        f"reward={'nan' if reward is None else format(reward, '.4f')} "
        f"loss={'nan' if loss is None else format(loss, '+.4f')} "
        f"step_time={record['step_time_s']:.2f}s "
        f"weight_version={record.get('weight_version', record['step'])} "
        f"snapshot_age={age}"
    )


class StartupClock:
    """Where a trainer's start-up goes: named phases, each with its wall clock (unix time)
    and the process's CPU time so far, from the process's own start.

    Why in the process: the benchmark sees only launch and first redispatch; the phases in
    between (imports, config, restore reads, model, workers, ledger) are only visible from
    inside, and CPU time is what a shared machine inflates least. The trainer puts
    :meth:`phases` into its ``run_started`` trace event.
    """

    def __init__(self) -> None:
        self._marks: list[tuple[str, float, float]] = []
        started = process_started_at()
        if started is not None:
            self._marks.append(("process_started", started, 0.0))

    def mark(self, phase: str) -> None:
        """Mark ``phase`` now (a phase marked again, as by a second run in one process,
        moves to now)."""
        self._marks = [mark for mark in self._marks if mark[0] != phase]
        self._marks.append((phase, time.time(), time.process_time()))

    def phases(self) -> dict[str, list[float]]:
        """``{phase: [unix_time, cpu_s]}`` in the order they were marked."""
        return {name: [round(t, 4), round(cpu, 4)] for name, t, cpu in self._marks}


def process_started_at() -> float | None:
    """This process's start (unix time, 10 ms resolution) from ``/proc`` (its start in
    ticks since boot against the uptime); None elsewhere."""
    import os

    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


#: The trainer process's one start-up clock (marked by ``trainer``, read at ``run_started``).
STARTUP = StartupClock()

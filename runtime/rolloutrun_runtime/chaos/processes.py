"""The harness's processes: the trainer incarnations it kills, and the reference run.

Why process groups and SIGKILL: a preemption gives no warning that reaches Python, so each
trainer incarnation (``rolloutrun trainer``) runs in its own process group and dies by
SIGKILL, at a random moment (:func:`random_kill`: between steps, or during startup and
restore) or at a named crash site armed through its environment. The reference run is an
uninterrupted ``rolloutrun train`` of the same config, for the final weights to match.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rolloutrun_runtime.contract.layout import (
    COMMIT_MARKER,
    DEFAULT_STORAGE_DIR,
    FINAL_WEIGHTS_FILE,
    MANIFEST_NAME,
    SNAPSHOT_DIR,
    SNAPSHOTS_PREFIX,
    STEP_ENTRY,
)

CHAOS_CONFIG = "chaos-run.yaml"
REFERENCE_DIR = "reference"
#: Seconds one incarnation may run before the harness gives up on it.
INCARNATION_TIMEOUT_S = 600.0
POLL_S = 0.02
#: Seconds a process gets between SIGINT and SIGKILL.
GRACE_S = 10.0
#: Share of kills that land during startup/restore rather than between steps.
STARTUP_KILL_SHARE = 0.25


class ChaosError(RuntimeError):
    """The harness cannot run or finish the campaign (the message says which and why)."""


def plan_steps_before_kill(rng: random.Random, steps_left: int, kills_left: int) -> int:
    """Train steps this incarnation completes before its kill: spread over the kills left."""
    span = max(1, steps_left // (kills_left + 1))
    return rng.randint(1, span)


def has_durable_state(log_dir: Path) -> bool:
    """Whether the run's storage holds a committed trainer checkpoint or snapshot."""
    root = log_dir / DEFAULT_STORAGE_DIR
    return any(STEP_ENTRY.match(p.parent.name) for p in root.glob(f"*/{COMMIT_MARKER}")) or any(
        SNAPSHOT_DIR.match(p.parent.name)
        for p in root.glob(f"{SNAPSHOTS_PREFIX}/*/{MANIFEST_NAME}")
    )


def steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    last = 0
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return last


def write_chaos_config(config_file: Path, log_dir: Path, endpoints: list[str]) -> Path:
    """The run's config with the harness's log dir, storage under it, and the Gym endpoints."""
    import yaml

    from rolloutrun_runtime.contract.run_config import RunConfig, load_run_config

    cfg = load_run_config(config_file)
    data = cfg.to_yaml_dict()
    data["logDir"] = str(log_dir)
    data.setdefault("checkpointing", {}).pop("storageUri", None)
    data.setdefault("gym", {})["endpoints"] = endpoints
    RunConfig.model_validate(data)
    path = log_dir / CHAOS_CONFIG
    path.write_text(yaml.safe_dump(data, sort_keys=True))
    return path


def _trainer_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "rolloutrun_runtime.cli", "trainer", "--config", str(config)]


def start_trainer(
    config: Path, log_dir: Path, index: int, env: Mapping[str, str]
) -> tuple[subprocess.Popen[bytes], IO[str]]:
    log = (log_dir / f"chaos-trainer-{index}.log").open("w")
    process = subprocess.Popen(
        _trainer_command(config),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(env),
        start_new_session=True,
    )
    return process, log


def _kill_group(process: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def wait_trainer(process: subprocess.Popen[Any], deadline: float, timeout_s: float) -> int:
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise ChaosError(f"trainer pid {process.pid} ran past {timeout_s:.0f} s") from None


def run_reference(
    config_file: Path, log_dir: Path, timeout_s: float = INCARNATION_TIMEOUT_S
) -> str:
    """An uninterrupted run of the same config (``rolloutrun train``); its weights digest."""
    ref_dir = log_dir / REFERENCE_DIR
    ref_dir.mkdir(parents=True, exist_ok=True)
    ref_config = write_chaos_config(config_file, ref_dir, [])
    command = [sys.executable, "-m", "rolloutrun_runtime.cli", "train", str(ref_config)]
    command += ["--log-dir", str(ref_dir), "--quiet"]
    with (ref_dir / "chaos-reference.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # SIGINT lets the launcher stop its Gym replicas (they are in their own groups).
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise ChaosError(
                f"the reference run ran past {timeout_s:.0f} s; see {ref_dir}"
            ) from None
    if rc != 0:
        raise ChaosError(f"the reference run failed (exit {rc}); see {ref_dir}")
    return (ref_dir / FINAL_WEIGHTS_FILE).read_text().strip()


def recent_step_s(metrics: Path, last: int = 5) -> float | None:
    """The mean ``step_time_s`` of the last ``last`` steps in ``metrics.jsonl`` (None: none yet)."""
    if not metrics.exists():
        return None
    times: list[float] = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            times.append(float(json.loads(line)["step_time_s"]))
        except (ValueError, KeyError, TypeError):
            continue
    return sum(times[-last:]) / len(times[-last:]) if times else None


def planned_kill(
    process: subprocess.Popen[Any],
    position: float,
    metrics: Path,
    deadline: float,
) -> str:
    """SIGKILL the trainer's group at run progress ``position`` (in train steps): once the
    run has completed step ``floor(position)``, after that fraction of a step's time.

    ``12.05`` lands right after step 12 completes, ``11.95`` near the end of step 12.
    Returns ``planned``, or ``planned-missed`` when the process ended (or the deadline
    passed) first.
    """
    whole = int(position)
    while steps_done(metrics) < whole:
        if process.poll() is not None or time.monotonic() > deadline:
            return "planned-missed"
        time.sleep(POLL_S)
    step_s = recent_step_s(metrics) or 0.0
    time.sleep((position - whole) * step_s)
    if process.poll() is not None:
        return "planned-missed"
    _kill_group(process)
    return "planned"


def random_kill(
    process: subprocess.Popen[Any],
    rng: random.Random,
    metrics: Path,
    steps_before: int,
    max_steps: int,
    kills_left: int,
    startup_s: float | None,
    deadline: float,
) -> tuple[str, float | None]:
    """SIGKILL the trainer's group at a random moment.

    Returns where it aimed (``step``, ``startup`` or ``…-missed`` when the process ended
    first) and the seconds from launch to the incarnation's first step, when seen.
    """
    launched = time.monotonic()
    if startup_s is not None and rng.random() < STARTUP_KILL_SHARE:
        target = launched + rng.uniform(0.0, startup_s)
        while time.monotonic() < target:
            if process.poll() is not None:
                return "startup-missed", None
            time.sleep(POLL_S)
        _kill_group(process)
        return "startup", None
    steps = plan_steps_before_kill(rng, max_steps - steps_before, kills_left)
    goal = min(max_steps - 1, steps_before + steps)
    first_step: float | None = None
    while (done := steps_done(metrics)) < goal or first_step is None:
        if first_step is None and done > steps_before:
            first_step = time.monotonic()
            continue
        if process.poll() is not None or time.monotonic() > deadline:
            return "step-missed", None
        time.sleep(POLL_S)
    # A random fraction of one step's time (the incarnation's mean so far) past the goal.
    per_step = (time.monotonic() - first_step) / max(1, done - steps_before)
    time.sleep(rng.uniform(0.0, per_step))
    if process.poll() is not None:
        return "step-missed", first_step - launched
    _kill_group(process)
    return "step", first_step - launched

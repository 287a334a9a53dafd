"""``rolloutrun chaos FILE --kills N``: kill a real run repeatedly, resume it, prove it whole.

Why processes and SIGKILL: a preemption gives no warning that reaches Python — no
``finally``, no atexit, no flushed buffer. Only a real process killed with SIGKILL shows
that what the runtime wrote before the kill is enough to resume without losing or repeating
work. The harness plays the cluster's part: the Gym replicas are started once and survive
every kill (they are other pods), the trainer (``rolloutrun trainer``, its own process
group) is SIGKILLed at a random moment or, with ``--site``, at a named crash site
(:mod:`rolloutrun_runtime.crash`), and restarted on the same log directory, where it
resumes from the newest valid snapshot or trainer checkpoint. After the last incarnation
reaches ``maxSteps`` the run is audited from durable state (:mod:`rolloutrun_runtime.audit`)
and, for a deterministic config, its final weights are compared with an uninterrupted run.

Per kill the report gives the trace analyzer's ``thrown_away_s`` (attempts abandoned at the
restart, dispatch to cut) and ``rollout_work_lost_s``: all rollout seconds of the killed
incarnation that the resumed one cannot keep (work after the restored cut, plus the part
before it of attempts abandoned at the restart). The second one is what a trainer-only
restart loses too, so it compares snapshot and trainer-checkpoint restarts fairly.

Random kill moments: each incarnation runs a random number of train steps (spread so the
remaining kills fit before ``maxSteps``) plus a random fraction of a step; one kill in four
lands instead at a random moment of the incarnation's startup and restore.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

CHAOS_CONFIG = "chaos-run.yaml"
REFERENCE_DIR = "reference"
#: Seconds one incarnation may run before the harness gives up on it.
INCARNATION_TIMEOUT_S = 600.0
POLL_S = 0.02
#: Seconds a process gets between SIGINT and SIGKILL.
GRACE_S = 10.0
#: Share of kills that land during startup/restore rather than between steps.
STARTUP_KILL_SHARE = 0.25
#: Sites reached once per incarnation, and only by one that restores.
RESTORE_SITES = ("during_restore", "during_gym_resume")
#: Where the first incarnation of a restore-site campaign dies: its first snapshot is durable.
PRIMING_SITE = "after_manifest_write"
#: Highest hit count a ``--site`` kill is armed with (chosen at random from 1..this).
MAX_SITE_HIT = 3


class ChaosError(RuntimeError):
    """The harness cannot run or finish the campaign (the message says which and why)."""


@dataclasses.dataclass
class Kill:
    """One SIGKILL of the trainer."""

    index: int
    how: str  # "random-step", "random-startup" or "site"
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


# --------------------------------------------------------------------------- pure helpers
def plan_steps_before_kill(rng: random.Random, steps_left: int, kills_left: int) -> int:
    """Train steps this incarnation completes before its kill: spread over the kills left."""
    span = max(1, steps_left // (kills_left + 1))
    return rng.randint(1, span)


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
            if cut is None and "step_" in source:
                step = int(source.rstrip("/").rsplit("step_", 1)[1])
                cut = completed.get(step)
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
    lost = 0.0
    for uuid, start in starts.items():
        end = ends.get(uuid, stop)
        lost += max(0.0, end - max(start, cut))
        if uuid in abandoned and start < cut:
            lost += cut - start
    return lost


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


# --------------------------------------------------------------------------- processes
def _has_durable_state(log_dir: Path) -> bool:
    """Whether the run's storage holds a committed trainer checkpoint or snapshot."""
    root = log_dir / "checkpoints"
    return any(root.glob("step_*/COMMITTED")) or any(
        root.glob("rollout_snapshots/snapshot_*/MANIFEST.json")
    )


def _steps_done(metrics: Path) -> int:
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


def _start_trainer(
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


def _wait(process: subprocess.Popen[Any], deadline: float, timeout_s: float) -> int:
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise ChaosError(f"trainer pid {process.pid} ran past {timeout_s:.0f} s") from None


def run_reference(
    config_file: Path, log_dir: Path, timeout_s: float = INCARNATION_TIMEOUT_S
) -> str:
    """An uninterrupted run of the same config (``rolloutrun train``); its weights digest."""
    from rolloutrun_runtime.metrics import FINAL_WEIGHTS_FILE

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


@dataclasses.dataclass
class ChaosResult:
    kills: list[Kill]
    resumes: int
    incarnations: int
    exit_codes: list[int]
    audit: dict[str, Any]
    weights_match: bool | None
    final_weights_sha256: str
    reference_weights_sha256: str | None
    wall_s: float
    site: str | None
    seed: int
    launched_at: list[float] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.audit.get("ok")) and self.weights_match is not False

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "kills": len(self.kills),
            "resumes": self.resumes,
            "incarnations": self.incarnations,
            "exit_codes": self.exit_codes,
            "site": self.site,
            "seed": self.seed,
            "audit": self.audit,
            "weights_match": self.weights_match,
            "final_weights_sha256": self.final_weights_sha256,
            "reference_weights_sha256": self.reference_weights_sha256,
            "thrown_away_s": [round(k.thrown_away_s, 6) for k in self.kills],
            "rollout_work_lost_s": [round(k.rollout_work_lost_s, 6) for k in self.kills],
            "lost_progress_s": [
                None if k.lost_progress_s is None else round(k.lost_progress_s, 6)
                for k in self.kills
            ],
            "kill_details": [dataclasses.asdict(k) for k in self.kills],
            "incarnations_launched_at": self.launched_at,
            "wall_s": round(self.wall_s, 3),
        }


def run_chaos(
    config_file: Path,
    log_dir: Path,
    *,
    kills: int,
    seed: int = 0,
    site: str | None = None,
    compare: bool | None = None,
    reference_sha256: str | None = None,
    incarnation_timeout_s: float = INCARNATION_TIMEOUT_S,
) -> ChaosResult:
    """Run ``config_file`` to ``maxSteps`` under ``kills`` SIGKILLs; audit; compare weights."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TRACE_FILE, read_events
    from rolloutrun_runtime.audit import AuditError, run_audit
    from rolloutrun_runtime.contract.run_config import load_run_config
    from rolloutrun_runtime.crash import ENV_VAR, CrashConfigError, parse_crash_at
    from rolloutrun_runtime.launcher import ENV_GYM_CONTROL_TOKEN, start_gym, stop_process
    from rolloutrun_runtime.metrics import FINAL_WEIGHTS_FILE, METRICS_FILE

    site_name, site_hit = None, None
    if site is not None:
        try:
            site_name, site_hit = parse_crash_at(site)
        except CrashConfigError as error:
            raise ChaosError(str(error)) from None
        if ":" not in site:
            site_hit = None
    if kills < 0:
        raise ChaosError("--kills must be >= 0")
    cfg = load_run_config(config_file)
    max_steps = cfg.grpo.max_steps
    if log_dir.exists() and any(log_dir.iterdir()):
        raise ChaosError(f"{log_dir} is not empty: a chaos campaign starts a new run")
    log_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    started = time.monotonic()
    if compare is None:
        compare = cfg.checkpointing.deterministic
    reference = reference_sha256
    if compare and reference is None:
        reference = run_reference(config_file, log_dir, incarnation_timeout_s)

    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    # Turn-level recovery: the Gym replicas and every trainer incarnation share one token.
    env[ENV_GYM_CONTROL_TOKEN] = secrets.token_hex(16)
    gyms = []
    done_kills: list[Kill] = []
    exit_codes: list[int] = []
    launched_at: list[float] = []
    metrics = log_dir / METRICS_FILE
    try:
        saved_token = os.environ.get(ENV_GYM_CONTROL_TOKEN)
        os.environ[ENV_GYM_CONTROL_TOKEN] = env[ENV_GYM_CONTROL_TOKEN]
        try:
            for index in range(cfg.gym.replicas):
                gyms.append(start_gym(config_file, log_dir, index))
        finally:
            if saved_token is None:
                os.environ.pop(ENV_GYM_CONTROL_TOKEN, None)
            else:
                os.environ[ENV_GYM_CONTROL_TOKEN] = saved_token
        run_config = write_chaos_config(config_file, log_dir, [g.url for g in gyms])
        startup_s: float | None = None
        incarnation = 0
        while True:
            incarnation += 1
            steps_before = _steps_done(metrics)
            kill_now = len(done_kills) < kills and steps_before < max_steps
            proc_env = dict(env)
            hit = None
            how = "none"
            # A restore site is only reached by an incarnation that has something to restore:
            # the first one is killed right after its first snapshot is published instead.
            priming = site_name in RESTORE_SITES and not _has_durable_state(log_dir)
            at_site = site is not None
            kill_site = PRIMING_SITE if priming else site_name
            if kill_now and at_site:
                hit = 1 if priming else (site_hit or rng.randint(1, MAX_SITE_HIT))
                proc_env[ENV_VAR] = f"{kill_site}:{hit}"
                how = "site"
            launched = time.monotonic()
            launched_at.append(time.time())
            process, log = _start_trainer(run_config, log_dir, incarnation, proc_env)
            deadline = launched + incarnation_timeout_s
            try:
                if kill_now and not at_site:
                    how, first_step_s = _random_kill(
                        process,
                        rng,
                        metrics,
                        steps_before,
                        max_steps,
                        kills - len(done_kills),
                        startup_s,
                        deadline,
                    )
                    startup_s = startup_s if first_step_s is None else first_step_s
                rc = _wait(process, deadline, incarnation_timeout_s)
            finally:
                log.close()
            exit_codes.append(rc)
            if rc == -signal.SIGKILL:
                done_kills.append(
                    Kill(
                        index=len(done_kills),
                        how={"site": "site", "step": "random-step"}.get(how, "random-startup"),
                        site=kill_site if how == "site" else None,
                        hit=hit,
                        steps_before=steps_before,
                        steps_at_kill=_steps_done(metrics),
                        killed_at=time.time(),
                        incarnation_s=time.monotonic() - launched,
                    )
                )
                continue
            if rc != 0:
                raise ChaosError(
                    f"trainer incarnation {incarnation} exited {rc} (not a kill); see "
                    f"{log_dir / f'chaos-trainer-{incarnation}.log'}"
                )
            break
    finally:
        for gym in gyms:
            stop_process(gym.process)
            gym.log.close()

    trace = log_dir / TRACE_FILE
    if trace.exists():
        reference_trace = log_dir / REFERENCE_DIR / TRACE_FILE
        baseline = list(read_events(reference_trace)) if reference_trace.exists() else None
        attribute_stops(done_kills, list(read_events(trace)), baseline)
    try:
        report = run_audit(log_dir, config_file=run_config).to_json()
    except AuditError as error:
        report = {"ok": False, "error": str(error)}
    final = (log_dir / FINAL_WEIGHTS_FILE).read_text().strip()
    return ChaosResult(
        kills=done_kills,
        resumes=len(exit_codes) - 1,
        incarnations=len(exit_codes),
        exit_codes=exit_codes,
        audit=report,
        weights_match=None if reference is None else final == reference,
        final_weights_sha256=final,
        reference_weights_sha256=reference,
        wall_s=time.monotonic() - started,
        site=site,
        seed=seed,
        launched_at=launched_at,
    )


def _random_kill(
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
    while (done := _steps_done(metrics)) < goal or first_step is None:
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


# --------------------------------------------------------------------------- CLI
def register(parser: argparse.ArgumentParser) -> None:
    """SIGKILL a run's trainer N times, resume it each time, then audit it."""
    parser.add_argument("file", help="RolloutRun YAML (its spec.run) or a bare RunConfig")
    parser.add_argument("--kills", type=int, required=True, help="how many SIGKILLs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument(
        "--site",
        default=None,
        help="kill at this named crash site, NAME or NAME:HIT (default: a random hit 1..3)",
    )
    parser.add_argument("--log-dir", default=None, help="new directory for the run (default: tmp)")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare final weights with an uninterrupted run (default: deterministic configs)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    import tempfile

    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="rr-chaos-"))
    try:
        result = run_chaos(
            Path(args.file),
            log_dir,
            kills=args.kills,
            seed=args.seed,
            site=args.site,
            compare=args.compare,
        )
    except ChaosError as error:
        print(f"rolloutrun chaos: {error}", file=sys.stderr)
        return 2
    data = result.to_json()
    data["log_dir"] = str(log_dir)
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        audit = result.audit
        print(
            f"chaos {'OK' if result.ok else 'FAILED'}: {len(result.kills)} kills, "
            f"{result.resumes} resumes; audit lost {audit.get('lost')} duplicated "
            f"{audit.get('duplicated')} ok {audit.get('ok')}; weights_match "
            f"{result.weights_match}; thrown away {data['thrown_away_s']} s; logs in {log_dir}"
        )
    return 0 if result.ok else 1

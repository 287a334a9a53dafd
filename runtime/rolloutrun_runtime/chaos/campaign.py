"""One chaos campaign: plan it, run the trainer incarnations and their kills, check, report.

Why named steps: a campaign is a loop of incarnations around a kill plan (which site and
hit, or a random moment), with Gym replicas that outlive every kill, followed by the checks
that make it worth running (the trace's cost per kill, the audit from durable state, the
final weights against an uninterrupted run). Each step is one function here; the processes
are :mod:`.processes`, the per-kill accounting :mod:`.accounting`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from rolloutrun_runtime.chaos.accounting import Kill, attribute_stops
from rolloutrun_runtime.chaos.processes import (
    INCARNATION_TIMEOUT_S,
    REFERENCE_DIR,
    ChaosError,
    has_durable_state,
    planned_kill,
    random_kill,
    run_reference,
    start_trainer,
    steps_done,
    wait_trainer,
    write_chaos_config,
)
from rolloutrun_runtime.contract.layout import FINAL_WEIGHTS_FILE, METRICS_FILE, TRACE_FILE

#: Sites reached once per incarnation, and only by one that restores.
RESTORE_SITES = ("during_restore", "during_gym_resume")
#: Where the first incarnation of a restore-site campaign dies: its first snapshot is durable.
PRIMING_SITE = "after_manifest_write"
#: Highest hit count a ``--site`` kill is armed with (chosen at random from 1..this).
MAX_SITE_HIT = 3


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


@dataclasses.dataclass
class _Campaign:
    """The plan every incarnation of one campaign shares, and what they have done so far."""

    log_dir: Path
    kills: int
    max_steps: int
    site: str | None
    site_name: str | None
    site_hit: int | None
    rng: random.Random
    env: dict[str, str]
    incarnation_timeout_s: float
    #: Planned kill moments in run progress (train steps, see ``planned_kill``); None: random.
    kill_at: list[float] | None = None
    done_kills: list[Kill] = dataclasses.field(default_factory=list)
    exit_codes: list[int] = dataclasses.field(default_factory=list)
    launched_at: list[float] = dataclasses.field(default_factory=list)
    #: Seconds from launch to the first step, as the last incarnation that got there saw it.
    startup_s: float | None = None

    @property
    def metrics(self) -> Path:
        return self.log_dir / METRICS_FILE


# --------------------------------------------------------------------------- plan
def _parse_site(site: str | None) -> tuple[str | None, int | None]:
    """``NAME`` or ``NAME:HIT`` -> ``(name, hit)``; the hit is None unless the value gives it."""
    from rolloutrun_runtime.crash import CrashConfigError, parse_crash_at

    if site is None:
        return None, None
    try:
        site_name, site_hit = parse_crash_at(site)
    except CrashConfigError as error:
        raise ChaosError(str(error)) from None
    return site_name, (site_hit if ":" in site else None)


def _plan(
    config_file: Path,
    log_dir: Path,
    *,
    kills: int,
    seed: int,
    site: str | None,
    incarnation_timeout_s: float,
    kill_at: list[float] | None = None,
) -> tuple[_Campaign, Any]:
    """Check the request and lay the campaign out (nothing started yet); also the config."""
    from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
    from rolloutrun_runtime.contract.run_config import load_run_config
    from rolloutrun_runtime.crash import ENV_VAR

    site_name, site_hit = _parse_site(site)
    if kills < 0:
        raise ChaosError("--kills must be >= 0")
    cfg = load_run_config(config_file)
    if kill_at is not None:
        kill_at = check_kill_plan(kill_at, kills, cfg.grpo.max_steps, site)
    if log_dir.exists() and any(log_dir.iterdir()):
        raise ChaosError(f"{log_dir} is not empty: a chaos campaign starts a new run")
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    # Turn-level recovery: the Gym replicas and every trainer incarnation share one token.
    env[ENV_GYM_TOKEN] = secrets.token_hex(16)
    campaign = _Campaign(
        log_dir=log_dir,
        kills=kills,
        max_steps=cfg.grpo.max_steps,
        site=site,
        site_name=site_name,
        site_hit=site_hit,
        rng=random.Random(seed),
        env=env,
        incarnation_timeout_s=incarnation_timeout_s,
        kill_at=kill_at,
    )
    return campaign, cfg


def check_kill_plan(
    kill_at: list[float], kills: int, max_steps: int, site: str | None
) -> list[float]:
    """A planned campaign's kill moments, sorted; refused unless there is one per kill, each
    inside the run (after step 1 starts, before ``maxSteps`` completes) and a step apart."""
    plan = sorted(float(p) for p in kill_at)
    if site is not None:
        raise ChaosError("a kill plan (kill_at) and --site are exclusive")
    if len(plan) != kills:
        raise ChaosError(f"kill_at has {len(plan)} moments for {kills} kills")
    if plan and (plan[0] < 0.0 or plan[-1] >= max_steps):
        raise ChaosError(f"kill_at {plan} must lie in [0, maxSteps {max_steps})")
    if any(b - a < 1.0 for a, b in itertools.pairwise(plan)):
        raise ChaosError(f"kill_at {plan}: moments must be at least one step apart")
    return plan


def _start_gyms(
    gyms: list[Any], config_file: Path, log_dir: Path, replicas: int, token: str
) -> None:
    """Start the Gym replicas into ``gyms`` (the caller stops them, even those started before
    a failure): they hold the campaign's control token and outlive every kill."""
    from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
    from rolloutrun_runtime.launcher import start_gym

    saved_token = os.environ.get(ENV_GYM_TOKEN)
    os.environ[ENV_GYM_TOKEN] = token
    try:
        for index in range(replicas):
            gyms.append(start_gym(config_file, log_dir, index))
    finally:
        if saved_token is None:
            os.environ.pop(ENV_GYM_TOKEN, None)
        else:
            os.environ[ENV_GYM_TOKEN] = saved_token


def _arm(
    campaign: _Campaign, steps_before: int
) -> tuple[bool, str | None, int | None, dict[str, str]]:
    """This incarnation's kill plan: ``(kill it, site, hit, its environment)``.

    A restore site is only reached by an incarnation that has something to restore: the
    first one is killed right after its first snapshot is published instead.
    """
    from rolloutrun_runtime.crash import ENV_VAR

    kill_now = len(campaign.done_kills) < campaign.kills and steps_before < campaign.max_steps
    proc_env = dict(campaign.env)
    hit = None
    priming = campaign.site_name in RESTORE_SITES and not has_durable_state(campaign.log_dir)
    kill_site = PRIMING_SITE if priming else campaign.site_name
    if kill_now and campaign.site is not None:
        hit = 1 if priming else (campaign.site_hit or campaign.rng.randint(1, MAX_SITE_HIT))
        proc_env[ENV_VAR] = f"{kill_site}:{hit}"
    return kill_now, kill_site, hit, proc_env


# --------------------------------------------------------------------------- run one kill
def _run_incarnation(campaign: _Campaign, run_config: Path, incarnation: int) -> bool:
    """Launch one trainer incarnation, kill it as planned, wait for it to end.

    True when it was killed (the campaign goes on), False when it completed the run; an
    incarnation that fails otherwise is a :class:`ChaosError`.
    """
    steps_before = steps_done(campaign.metrics)
    kill_now, kill_site, hit, proc_env = _arm(campaign, steps_before)
    at_site = campaign.site is not None
    how = "site" if kill_now and at_site else "none"
    launched = time.monotonic()
    campaign.launched_at.append(time.time())
    process, log = start_trainer(run_config, campaign.log_dir, incarnation, proc_env)
    deadline = launched + campaign.incarnation_timeout_s
    try:
        if kill_now and campaign.kill_at is not None:
            position = campaign.kill_at[len(campaign.done_kills)]
            how = planned_kill(process, position, campaign.metrics, deadline)
        elif kill_now and not at_site:
            how, first_step_s = random_kill(
                process,
                campaign.rng,
                campaign.metrics,
                steps_before,
                campaign.max_steps,
                campaign.kills - len(campaign.done_kills),
                campaign.startup_s,
                deadline,
            )
            campaign.startup_s = campaign.startup_s if first_step_s is None else first_step_s
        rc = wait_trainer(process, deadline, campaign.incarnation_timeout_s)
    finally:
        log.close()
    campaign.exit_codes.append(rc)
    if rc == -signal.SIGKILL:
        campaign.done_kills.append(
            Kill(
                index=len(campaign.done_kills),
                how={"site": "site", "step": "random-step", "planned": "planned"}.get(
                    how, "random-startup"
                ),
                site=kill_site if how == "site" else None,
                hit=hit,
                steps_before=steps_before,
                steps_at_kill=steps_done(campaign.metrics),
                killed_at=time.time(),
                incarnation_s=time.monotonic() - launched,
            )
        )
        return True
    if rc != 0:
        raise ChaosError(
            f"trainer incarnation {incarnation} exited {rc} (not a kill); see "
            f"{campaign.log_dir / f'chaos-trainer-{incarnation}.log'}"
        )
    return False


def _run_incarnations(campaign: _Campaign, run_config: Path) -> None:
    """Incarnation after incarnation on the same log directory until one completes the run."""
    incarnation = 1
    while _run_incarnation(campaign, run_config, incarnation):
        incarnation += 1


# --------------------------------------------------------------------------- check, report
def _check_invariants(log_dir: Path, run_config: Path, kills: list[Kill]) -> dict[str, Any]:
    """Attribute the trace's stops to the kills, then audit the run from durable state."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
    from rolloutrun_runtime.audit import AuditError, run_audit

    trace = log_dir / TRACE_FILE
    if trace.exists():
        reference_trace = log_dir / REFERENCE_DIR / TRACE_FILE
        baseline = list(read_events(reference_trace)) if reference_trace.exists() else None
        attribute_stops(kills, list(read_events(trace)), baseline)
    try:
        return run_audit(log_dir, config_file=run_config).to_json()
    except AuditError as error:
        return {"ok": False, "error": str(error)}


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
    kill_at: list[float] | None = None,
) -> ChaosResult:
    """Run ``config_file`` to ``maxSteps`` under ``kills`` SIGKILLs; audit; compare weights.

    ``kill_at``: one moment per kill in run progress (train steps: ``10.05`` right after step
    10 completes), the same on every run given it; default: random moments (package doc).
    """
    from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
    from rolloutrun_runtime.launcher import stop_process

    campaign, cfg = _plan(
        config_file,
        log_dir,
        kills=kills,
        seed=seed,
        site=site,
        incarnation_timeout_s=incarnation_timeout_s,
        kill_at=kill_at,
    )
    started = time.monotonic()
    if compare is None:
        compare = cfg.checkpointing.deterministic
    reference = reference_sha256
    if compare and reference is None:
        reference = run_reference(config_file, log_dir, incarnation_timeout_s)
    gyms: list[Any] = []
    try:
        token = campaign.env[ENV_GYM_TOKEN]
        _start_gyms(gyms, config_file, log_dir, cfg.gym.servers, token)
        run_config = write_chaos_config(config_file, log_dir, [g.url for g in gyms])
        _run_incarnations(campaign, run_config)
    finally:
        for gym in gyms:
            stop_process(gym.process)
            gym.log.close()
    report = _check_invariants(log_dir, run_config, campaign.done_kills)
    final = (log_dir / FINAL_WEIGHTS_FILE).read_text().strip()
    return ChaosResult(
        kills=campaign.done_kills,
        resumes=len(campaign.exit_codes) - 1,
        incarnations=len(campaign.exit_codes),
        exit_codes=campaign.exit_codes,
        audit=report,
        weights_match=None if reference is None else final == reference,
        final_weights_sha256=final,
        reference_weights_sha256=reference,
        wall_s=time.monotonic() - started,
        site=site,
        seed=seed,
        launched_at=campaign.launched_at,
    )

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

The package: :mod:`.campaign` (plan, run the incarnations and their kills, check, report),
:mod:`.processes` (the trainer incarnations, the kills, the reference run),
:mod:`.accounting` (each kill's cost from the trace), :mod:`.cli` (``rolloutrun chaos``).
"""

from rolloutrun_runtime.chaos.accounting import (
    Kill,
    attribute_stops,
    restore_cut_times,
    rollout_work_lost,
)
from rolloutrun_runtime.chaos.campaign import (
    MAX_SITE_HIT,
    PRIMING_SITE,
    RESTORE_SITES,
    ChaosResult,
    run_chaos,
)
from rolloutrun_runtime.chaos.cli import main, register
from rolloutrun_runtime.chaos.processes import (
    CHAOS_CONFIG,
    GRACE_S,
    INCARNATION_TIMEOUT_S,
    POLL_S,
    REFERENCE_DIR,
    STARTUP_KILL_SHARE,
    ChaosError,
    plan_steps_before_kill,
    run_reference,
    write_chaos_config,
)

__all__ = [
    "CHAOS_CONFIG",
    "GRACE_S",
    "INCARNATION_TIMEOUT_S",
    "MAX_SITE_HIT",
    "POLL_S",
    "PRIMING_SITE",
    "REFERENCE_DIR",
    "RESTORE_SITES",
    "STARTUP_KILL_SHARE",
    "ChaosError",
    "ChaosResult",
    "Kill",
    "attribute_stops",
    "main",
    "plan_steps_before_kill",
    "register",
    "restore_cut_times",
    "rollout_work_lost",
    "run_chaos",
    "run_reference",
    "write_chaos_config",
]

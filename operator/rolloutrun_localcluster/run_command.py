"""``rolloutrun run FILE``: the command around :class:`~.embedded.EmbeddedRun`.

Kept apart from the run itself so the end-to-end tests and benchmarks that drive
``EmbeddedRun`` do not carry the terminal concerns: arguments, the one-line-per-change
display, the summary file and line, the exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rolloutrun_operator.naming import Role

from .embedded import (
    SUMMARY_FILE,
    EmbeddedRun,
    EmbeddedRunError,
    condition_of,
    load_document,
    localize,
)

logger = logging.getLogger(__name__)


def register(parser: argparse.ArgumentParser) -> None:
    """Run a RolloutRun on a local cluster with the operator, to the end; write a summary."""
    parser.add_argument("file", help="a RolloutRun YAML (e.g. examples/tiny-grpo.yaml)")
    parser.add_argument(
        "--preempt-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="delete a random member pod at this interval, as a spot reclaim does",
    )
    parser.add_argument(
        "--max-preemptions",
        type=int,
        default=None,
        metavar="N",
        help="stop deleting pods after N deletions (default: no limit)",
    )
    parser.add_argument(
        "--preempt-while-training",
        action="store_true",
        help="count the interval only while the current incarnation trains (each deletion "
        "lands that far into training, never into a start-up)",
    )
    parser.add_argument(
        "--preempt-roles",
        type=preempt_roles,
        default=None,
        metavar="ROLES",
        help="whose pods the preemptions hit, comma-separated of trainer,gym,worker (default: "
        "all); a Gym or worker pod is replaced while the run goes on, a trainer pod ends the "
        "incarnation",
    )
    parser.add_argument(
        "--preempt-grace",
        type=int,
        default=None,
        metavar="SECONDS",
        help="the deleted pods' grace period (0: SIGKILL at once, as a node lost with its "
        "pods; default: the pod's own)",
    )
    parser.add_argument(
        "--summary", default=None, metavar="FILE.json", help="also write the summary here"
    )
    parser.add_argument(
        "--work-dir",
        default=None,
        help="cluster, storage and logs (default: .rolloutrun/<name>-<UTC time>)",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="override spec.run.grpo.maxSteps"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after SECONDS")
    parser.add_argument("--seed", type=int, default=None, help="seed the choice of victims")
    parser.add_argument("--verbose", action="store_true", help="log the operator's records")
    parser.set_defaults(handler=main)


class Display:
    """One terminal line per change: step, reward, incarnation, restarts, snapshot.

    After a restart the trainer resumes from the snapshot's train step, so the steps trained
    after it are trained again: the line then says so (``redo``, with the highest step
    reached) instead of seeming to lose progress silently.
    """

    def __init__(self, out: Any = None) -> None:
        self.out = out or sys.stdout
        self._last: tuple[Any, ...] | None = None
        self._highest = 0
        self._restarts = 0
        self._failure: Any = None

    def __call__(self, run: EmbeddedRun, status: dict[str, Any]) -> None:
        step = run.last_step() or {}
        ready = condition_of(status, "Ready") or {}
        key = (
            step.get("step"),
            status.get("incarnation"),
            status.get("restarts"),
            status.get("preemptions"),
            status.get("latestManifestUri"),
            ready.get("reason"),
        )
        if key == self._last:
            self._why(status)
            return
        self._last = key
        steps = ((run.document.get("spec") or {}).get("run") or {}).get("grpo", {})
        total = steps.get("maxSteps", "?")
        reward = step.get("reward_mean")
        snapshot = status.get("latestManifestUri")
        shown = f"{reward:6.3f}" if isinstance(reward, int | float) else "     -"
        current = int(step.get("step") or 0)
        self._highest = max(self._highest, current)
        redo = f" (redo, reached {self._highest})" if current < self._highest else ""
        line = (
            f"{run.elapsed():6.1f}s  step {current:>4}/{total}{redo}  reward {shown}"
            f"  incarnation {status.get('incarnation', 0)}"
            f"  restarts {status.get('restarts', 0)}"
            f"  preemptions {status.get('preemptions', 0)}"
            f"  snapshot {Path(snapshot).parent.name if snapshot else '-'}"
            f"  [{ready.get('reason', 'Pending')}]"
        )
        print(line, file=self.out, flush=True)
        self._why(status)

    def _why(self, status: dict[str, Any]) -> None:
        """Under a restart after a failure (not a preemption), or the run's end: the
        failure the operator recorded, its member's last line with it, once."""
        restarted = int(status.get("restarts") or 0) > self._restarts
        self._restarts = int(status.get("restarts") or 0)
        failure = status.get("lastFailure") or None
        if failure == self._failure or not failure:
            return
        if restarted or (condition_of(status, "Failed") or {}).get("status") == "True":
            self._failure = failure
            why = f"{failure.get('reason')}: {failure.get('message')}"
            print(f"         why: {why}", file=self.out, flush=True)


def preempt_roles(text: str) -> frozenset[str]:
    """``--preempt-roles``: member roles, comma-separated (an unknown one is refused)."""
    roles = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(roles - {role.value for role in Role})
    if unknown or not roles:
        known = ",".join(role.value for role in Role)
        raise argparse.ArgumentTypeError(
            f"unknown role(s) {', '.join(unknown) or '(none given)'}: choose from {known}"
        )
    return roles


def roles_without_pods(document: dict[str, Any], roles: frozenset[str]) -> list[str]:
    """The ``--preempt-roles`` this run has no pods of: worker pods exist only with
    ``spec.workers.replicas`` above 0 (a trainer and at least one Gym always do), so asking
    to preempt them would silently delete nothing."""
    replicas = ((document.get("spec") or {}).get("workers") or {}).get("replicas") or 0
    return sorted(role for role in roles if role == Role.WORKER.value and not replicas)


def default_work_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(".rolloutrun") / f"{name}-{stamp}"


def model_problem(document: dict[str, Any]) -> str | None:
    """Why the RolloutRun's local ``policy.model`` holds no model (None: it does, or is
    not local). Pods see this machine's files except ``/tmp``, so the check is meaningful."""
    from rolloutrun_runtime.contract.model_dir import local_model_problem

    run = (document.get("spec") or {}).get("run") or {}
    model = (run.get("policy") or {}).get("model")
    return local_model_problem(model) if isinstance(model, str) and model else None


def document_problem(document: dict[str, Any], work_dir: Path, source: str) -> str | None:
    """What ``rolloutrun validate`` finds in the run as this command applies it (its storage
    and log dir on the run's own claim), or None: the same checks the cluster's API server
    and the operator make, offline, so a bad field is named at once instead of after a
    cluster start."""
    from rolloutrun_operator.api.validation import RolloutRunInvalid, parse_rolloutrun

    try:
        parse_rolloutrun(localize(document, work_dir, "default"), source)
    except RolloutRunInvalid as error:
        return str(error)
    return None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    if not args.verbose:
        logging.getLogger("kopf").setLevel(logging.ERROR)
    try:
        document = load_document(args.file)
    except EmbeddedRunError as error:
        print(f"rolloutrun run: {error}", file=sys.stderr)
        return 2
    problem = model_problem(document)
    if problem:  # before a cluster starts: the pods would only fail on it
        print(f"rolloutrun run: {problem}", file=sys.stderr)
        return 2
    absent = roles_without_pods(document, args.preempt_roles or frozenset())
    if absent and args.preempt_every:
        name = (document.get("metadata") or {}).get("name")
        said = f"{name} has no {', '.join(absent)} pods (spec.workers.replicas is 0)"
        if set(absent) == set(args.preempt_roles):  # nothing could ever be deleted
            print(f"rolloutrun run: --preempt-roles: {said}: nothing to preempt", file=sys.stderr)
            return 2
        print(f"rolloutrun run: --preempt-roles: {said}; none will be deleted", file=sys.stderr)
    if args.max_steps is not None:
        run_spec = document.setdefault("spec", {}).setdefault("run", {})
        run_spec.setdefault("grpo", {})["maxSteps"] = args.max_steps
    name = document["metadata"]["name"]
    work_dir = Path(args.work_dir) if args.work_dir else default_work_dir(name)
    invalid = document_problem(document, work_dir, args.file)
    if invalid:  # what the API server would refuse, said before a cluster starts
        print(f"rolloutrun run: {invalid}", file=sys.stderr)
        return 2
    print(f"rolloutrun run: {name} in {work_dir} (local cluster, operator, pods)", flush=True)
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the cluster and its pods, as Ctrl-C does
    try:
        with EmbeddedRun(document, work_dir, cluster_options=_cluster_env()) as run:
            print(f"rolloutrun run: pods isolated by {run.isolation}", flush=True)
            result, preempted = run.follow(
                preempt_every=args.preempt_every,
                max_preemptions=args.max_preemptions,
                while_training=args.preempt_while_training,
                timeout=args.timeout,
                rng=rng,
                on_tick=Display(),
                roles=args.preempt_roles,
                grace_seconds=args.preempt_grace,
            )
            for at, victim in preempted.done:
                logger.info("deleted %s at %.1fs", victim, at)
            summary = run.summary(result, preempted)
    except EmbeddedRunError as error:
        print(f"rolloutrun run: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rolloutrun run: interrupted; the cluster and its pods were stopped", file=sys.stderr)
        return 130
    text = json.dumps(summary, indent=2, sort_keys=True)
    (work_dir / SUMMARY_FILE).write_text(text + "\n")
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(text + "\n")
    print(_summary_line(summary), flush=True)
    return 0 if summary["succeeded"] and summary["audit_holds"] else 1


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM ends ``rolloutrun run`` as Ctrl-C does: the run's ``with`` block stops the
    operator and the cluster, whose pods would otherwise outlive it."""
    raise KeyboardInterrupt


#: The audit's counts that break an invariant, as the summary line names them.
AUDIT_BREACHES = (
    ("lost", "prompts lost"),
    ("duplicated", "prompts trained twice"),
    ("side_effects_duplicated", "side effects applied twice"),
    ("gym_attempt_violations", "Gym attempt violations"),
    ("orphaned_staging_rows", "orphaned staging rows"),
)


def audit_words(summary: dict[str, Any]) -> str:
    """The audit as the summary line says it: ``holds``; ``could not run (why)`` when the
    durable state could not be audited (a run that failed before its first trainer
    checkpoint has none); or ``FAILS (...)`` naming each broken invariant's count."""
    audit = summary.get("audit") or {}
    if summary["audit_holds"]:
        return "holds"
    if "error" in audit:
        return f"could not run ({audit['error']})"
    breaches = [f"{words} {audit[key]}" for key, words in AUDIT_BREACHES if audit.get(key)]
    broken = [name for name, part in audit.items() if isinstance(part, dict) and not part.get("ok")]
    return f"FAILS ({', '.join(breaches or broken) or 'see the audit in ' + SUMMARY_FILE})"


def _summary_line(summary: dict[str, Any]) -> str:
    audit = audit_words(summary)
    replaced = ", ".join(
        f"{role} {record['count']}" for role, record in summary["member_replacements"].items()
    )
    return (
        f"{summary['result']}: {summary['steps']} steps, {summary['incarnations']} "
        f"incarnations, {summary['restarts']} restarts, {summary['preemptions']} preemptions, "
        f"members replaced: {replaced or 'none'}, "
        f"thrown away {_seconds(summary['thrown_away_s'])}, "
        f"audit {audit}, weights {summary['final_weights_sha256']}, {summary['wall_s']} s; "
        f"summary in {summary['work_dir']}/{SUMMARY_FILE}"
    )


def _seconds(value: float | None) -> str:
    """``12.3 s``, or ``unknown`` when the run kept no trace to measure it from."""
    return "unknown" if value is None else f"{value:.1f} s"


def _cluster_env() -> dict[str, Any]:
    """Pod processes write their output unbuffered, so pod logs show it as it happens."""
    return {"extra_env": {"PYTHONUNBUFFERED": "1"}}

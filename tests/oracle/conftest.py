"""The operator oracle: a preempted run through the operator ends as an uninterrupted one.

Why a separate oracle from ``tests/crash``: ``rolloutrun chaos`` kills only the trainer and
its Gym replicas survive every kill, so it never sees what a lost Gym pod does to a run
(an episode relaunched on another replica, a forced snapshot whose Gyms are gone, an empty
step). Here the whole path a cluster takes is exercised: ``rolloutrun run`` (local cluster,
operator, trainer and Gym pods) deletes member pods of either role every few seconds, and
the run must end with final weights bit-identical to ``rolloutrun train`` of the same
deterministic config, and with its audit holding (no prompt lost or trained twice, no side
effect applied twice). Both commands run as subprocesses, exactly as a user types them.

On a failure the message says what differed: the audit's counts and examples, the first
train step whose loss departs from the reference, the steps that closed with no groups.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: Seconds the reference ``rolloutrun train`` may take before the test gives up (a hang).
REFERENCE_BOUND_S = 600.0
#: Added to ``rolloutrun run --timeout`` for the subprocess's own bound (audit and trace).
SUMMARY_BOUND_S = 240.0
#: Seconds an interrupted command gets to stop its pods before it is killed.
STOP_GRACE_S = 30.0


def oracle_config(example: str, directory: Path, max_steps: int, worker_pods: int = 0) -> Path:
    """``examples/<example>.yaml`` in deterministic mode, restarting at once, ``max_steps``.

    Nothing else changes: the run is the example a user starts. ``worker_pods`` > 0: the
    generation workers run as that many Ray actors on as many worker pods
    (``spec.workers.replicas``; ``rolloutrun train`` of the same config runs the same
    actors beside its trainer)."""
    document = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    spec = document["spec"]
    spec["recovery"]["backoffSeconds"] = 0
    spec["run"]["checkpointing"]["deterministic"] = True
    spec["run"]["grpo"]["maxSteps"] = max_steps
    if worker_pods:
        spec["workers"] = {"replicas": worker_pods}
        spec["run"]["workers"] = {"backend": "ray", "generationWorkers": worker_pods}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{example}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def rolloutrun(args: list[str], log: Path, timeout: float) -> int:
    """``rolloutrun <args>`` as a user runs it; its output goes to ``log``; the exit code.

    Past ``timeout`` it is interrupted (SIGINT: both commands then stop their pods and Gym
    processes), killed only if that does not end it, and the test fails naming the log."""
    command = [sys.executable, "-m", "rolloutrun_runtime.cli", *args]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    raise AssertionError(f"rolloutrun {args[0]} ran past {timeout:.0f} s; see {log}")


def step_rows(metrics: Path) -> dict[int, dict[str, Any]]:
    """Per train step, the last ``metrics.jsonl`` row: a step trained again after a restore
    replaces the row of the incarnation that lost it."""
    rows: dict[int, dict[str, Any]] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            rows[int(row["step"])] = row
    return rows


def first_divergent_step(
    run: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]]
) -> int | None:
    """The first step whose loss (or groups) differs from the reference; None if none."""
    for step in sorted(reference):
        mine = run.get(step)
        if mine is None or (mine.get("loss"), mine.get("groups")) != (
            reference[step].get("loss"),
            reference[step].get("groups"),
        ):
            return step
    return None


@dataclasses.dataclass
class Oracle:
    """One preempted run and its uninterrupted reference, with what a failure should show."""

    summary: dict[str, Any]
    exit_code: int
    reference_sha256: str
    reference_rows: dict[int, dict[str, Any]]
    run_rows: dict[int, dict[str, Any]]
    directory: Path

    @property
    def deleted_roles(self) -> set[str]:
        """``trainer`` / ``gym`` / ``worker`` for each deleted pod (``<run>-i<N>-trainer``,
        ``-gym-<k>``, ``-worker-<k>``)."""
        return {
            "trainer"
            if name.endswith("-trainer")
            else "worker"
            if name.rpartition("-")[0].endswith("-worker")
            else "gym"
            for name in self.deleted
        }

    @property
    def deleted(self) -> list[str]:
        return list(self.summary.get("pods_deleted") or [])

    def explain(self) -> str:
        """Everything needed to see why the oracle failed, in one message."""
        audit = self.summary.get("audit") or {}
        empty = sorted(s for s, row in self.run_rows.items() if not row.get("groups"))
        facts = {
            "result": self.summary.get("result"),
            "exit_code": self.exit_code,
            "steps": self.summary.get("steps"),
            "incarnations": self.summary.get("incarnations"),
            "member_replacements": self.summary.get("member_replacements"),
            "restarts": self.summary.get("restarts"),
            "preemptions": self.summary.get("preemptions"),
            "pods_deleted": self.deleted,
            "final_weights_sha256": self.summary.get("final_weights_sha256"),
            "reference_sha256": self.reference_sha256,
            "first_divergent_step": first_divergent_step(self.run_rows, self.reference_rows),
            "steps_closed_with_no_groups": empty,
            "audit_holds": self.summary.get("audit_holds"),
            "audit": {
                "error": audit.get("error"),
                "prompts": {
                    k: (audit.get("prompts") or {}).get(k)
                    for k in ("lost", "duplicated", "undrawn", "lost_examples")
                },
                "side_effects": {
                    k: (audit.get("side_effects") or {}).get(k)
                    for k in ("applied", "duplicated", "torn_lines", "duplicated_examples")
                },
                "gym_attempts": {
                    k: (audit.get("gym_attempts") or {}).get(k) for k in ("violations", "examples")
                },
                "rows": (audit.get("rows") or {}).get("ok"),
            },
            "thrown_away_s": self.summary.get("thrown_away_s"),
            "wall_s": self.summary.get("wall_s"),
            "work_dir": str(self.directory),
        }
        return json.dumps(facts, indent=1, default=str)[:6000]


def run_oracle(
    example: str,
    directory: Path,
    *,
    max_steps: int,
    preempt_every: float,
    seed: int,
    max_preemptions: int | None = None,
    while_training: bool = False,
    timeout: float = 600.0,
    roles: str | None = None,
    worker_pods: int = 0,
    grace_seconds: int | None = None,
) -> Oracle:
    """The reference (``rolloutrun train``), then the preempted run (``rolloutrun run``).

    ``while_training``: ``preempt_every`` counts only while an incarnation trains, so every
    deletion hits a training run (a short run's few deletions never land in a start-up).
    ``roles``: ``--preempt-roles`` (whose pods are deleted; default both). ``worker_pods``:
    see :func:`oracle_config`. ``grace_seconds``: ``--preempt-grace`` (0: SIGKILL at once)."""
    config = oracle_config(example, directory, max_steps, worker_pods)
    reference_dir = directory / "reference"
    code = rolloutrun(
        ["train", str(config), "--log-dir", str(reference_dir), "--quiet"],
        directory / "reference.log",
        REFERENCE_BOUND_S,
    )
    assert code == 0, f"the reference run failed (exit {code}); see {directory / 'reference.log'}"
    reference_sha256 = (reference_dir / "final_weights.sha256").read_text().strip()
    work_dir = directory / "run"
    summary_file = directory / "summary.json"
    args = ["run", str(config), "--preempt-every", str(preempt_every), "--seed", str(seed)]
    if max_preemptions is not None:
        args += ["--max-preemptions", str(max_preemptions)]
    if while_training:
        args.append("--preempt-while-training")
    if roles is not None:
        args += ["--preempt-roles", roles]
    if grace_seconds is not None:
        args += ["--preempt-grace", str(grace_seconds)]
    args += ["--work-dir", str(work_dir), "--summary", str(summary_file)]
    args += ["--timeout", str(timeout)]
    code = rolloutrun(args, directory / "run.log", timeout + SUMMARY_BOUND_S)
    assert summary_file.exists(), f"rolloutrun run exited {code} with no summary; see run.log"
    return Oracle(
        summary=json.loads(summary_file.read_text()),
        exit_code=code,
        reference_sha256=reference_sha256,
        reference_rows=step_rows(reference_dir / "metrics.jsonl"),
        run_rows=step_rows(work_dir / "logs" / "metrics.jsonl"),
        directory=directory,
    )


def assert_oracle_holds(
    oracle: Oracle,
    max_steps: int,
    min_preemptions: int,
    roles: frozenset[str] = frozenset({"trainer", "gym"}),
) -> None:
    """Succeeded at ``max_steps`` after at least ``min_preemptions`` deleted members of
    ``roles``; weights bit-identical to the reference; audit clean on every count."""
    detail = oracle.explain()
    summary = oracle.summary
    assert summary["result"] == "Succeeded" and summary["steps"] == max_steps, detail
    assert len(oracle.deleted) >= min_preemptions, detail
    assert oracle.deleted_roles == roles, detail
    audit = summary["audit"]
    assert "error" not in audit, detail
    assert (audit["prompts"]["lost"], audit["prompts"]["duplicated"]) == (0, 0), detail
    assert audit["side_effects"]["applied"] > 0, detail
    assert audit["side_effects"]["duplicated"] == 0, detail
    assert audit["gym_attempts"]["violations"] == 0, detail
    assert summary["audit_holds"] is True and oracle.exit_code == 0, detail
    # A step closes on trained groups only, never on groups lost to infrastructure.
    assert all(row.get("groups") for row in oracle.run_rows.values()), detail
    assert summary["final_weights_sha256"] == oracle.reference_sha256, detail

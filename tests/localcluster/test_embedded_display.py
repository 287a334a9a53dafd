"""``rolloutrun run``'s live line: steps trained again after a restart are called a redo."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster.embedded import api_message, audit_holds, last_step, run_json_command
from rolloutrun_localcluster.run_command import (
    Display,
    _summary_line,
    audit_words,
    preempt_roles,
    roles_without_pods,
)
from tests.support.audit_runs import SEED, SIZE, perm, write_run

ROOT = Path(__file__).resolve().parents[2]


class _Run:
    """What the display reads of an embedded run: its metrics file, spec and clock."""

    def __init__(self, metrics: Path) -> None:
        self.metrics = metrics
        self.document = {"spec": {"run": {"grpo": {"maxSteps": 9}}}}

    def last_step(self) -> dict[str, Any] | None:
        return last_step(self.metrics)

    def elapsed(self) -> float:
        return 1.0


def test_a_restart_shows_the_redone_steps_and_the_highest_reached(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    run, out = _Run(metrics), io.StringIO()
    display = Display(out)
    status: dict[str, Any] = {"incarnation": 0}
    for step, incarnation in ((3, 0), (5, 0), (4, 1), (5, 1), (6, 1)):
        with metrics.open("a") as f:
            f.write(json.dumps({"step": step, "reward_mean": 0.5}) + "\n")
        status["incarnation"] = incarnation
        display(run, status)  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert [line.split("step")[1].split("reward")[0].strip() for line in lines] == [
        "3/9",
        "5/9",
        "4/9 (redo, reached 5)",
        "5/9",
        "6/9",
    ]


def test_a_restart_after_a_failure_says_why_once_and_a_preemption_says_nothing(
    tmp_path: Path,
) -> None:
    run, out = _Run(tmp_path / "metrics.jsonl"), io.StringIO()
    display = Display(out)
    mounts = "g-0: exit code 128: mountns: mount_setattr /r/storage/gym-audit: Invalid argument"
    deleted = {"reason": "PodDeleted", "pod": "t", "message": "t is being deleted"}
    failed = {"reason": "GymFailed", "pod": "g-0", "message": mounts}
    steps: list[dict[str, Any]] = [
        {"incarnation": 1, "restarts": 0, "preemptions": 1, "lastFailure": deleted},
        {"incarnation": 2, "restarts": 1, "preemptions": 1, "lastFailure": failed},
        {"incarnation": 2, "restarts": 1, "preemptions": 2, "lastFailure": failed},
        {"incarnation": 3, "restarts": 1, "preemptions": 2, "lastFailure": deleted},
    ]
    for status in steps:
        display(run, status)  # type: ignore[arg-type]
    whys = [line.strip() for line in out.getvalue().splitlines() if "why:" in line]
    assert whys == [f"why: GymFailed: {mounts}"]
    ended = {**steps[-1], "lastFailure": {**failed, "reason": "TrainerFailed"}}
    ended["conditions"] = [{"type": "Failed", "status": "True"}]
    display(run, ended)  # type: ignore[arg-type]
    assert out.getvalue().splitlines()[-1].strip() == f"why: TrainerFailed: {mounts}"


def test_the_summary_line_rounds_the_thrown_away_time_and_says_when_it_is_unknown() -> None:
    summary = {
        "result": "Succeeded",
        "steps": 300,
        "incarnations": 6,
        "member_replacements": {"gym": {"count": 2}},
        "restarts": 0,
        "preemptions": 5,
        "thrown_away_s": 18.155097723007202,
        "audit_holds": True,
        "audit": {},
        "final_weights_sha256": "2ac3",
        "wall_s": 91.81,
        "work_dir": "/runs/x",
    }
    assert "5 preemptions, members replaced: gym 2, thrown away 18.2 s, audit holds" in (
        _summary_line(summary)
    )
    assert "300 steps, 6 incarnations" in _summary_line(summary)
    summary["thrown_away_s"] = None  # a run without a trace
    assert "thrown away unknown, audit holds" in _summary_line(summary)


def test_the_summary_line_names_what_the_audit_found_or_why_it_could_not_run(
    tmp_path: Path,
) -> None:
    """The real ``rolloutrun audit --json`` as ``rolloutrun run`` calls it: a state that
    cannot be audited (a run that failed before its first trainer checkpoint) is not called
    a failed audit, and a failed one names the invariant it broke."""
    config = tmp_path / "run.yaml"
    config.write_text(f"seed: {SEED}\ntask: {{datasetSize: {SIZE}}}\ngrpo: {{maxSteps: 1}}\n")

    def words(run_dir: Path) -> str:
        audit = run_json_command(["audit", str(run_dir), "--config", str(config), "--json"])
        return audit_words({"audit": audit, "audit_holds": audit_holds(audit)})

    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    said = words(tmp_path / "empty")
    assert said.startswith("could not run (") and "no committed trainer checkpoint" in said
    write_run(tmp_path / "whole", trained_prompts=perm(0)[:4], position=4)
    assert words(tmp_path / "whole") == "holds"
    write_run(tmp_path / "lost", trained_prompts=perm(0)[:3], position=4)
    assert words(tmp_path / "lost") == "FAILS (prompts lost 1)"


def test_preempt_roles_are_member_roles() -> None:
    assert preempt_roles("gym") == {"gym"}
    assert preempt_roles("trainer, gym") == {"trainer", "gym"}
    assert preempt_roles("trainer,gym,worker") == {"trainer", "gym", "worker"}  # worker pods
    for bad in ("", "gym,nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from trainer,gym,worker"):
            preempt_roles(bad)


def test_preempting_a_role_the_run_has_no_pods_of_is_said_not_silently_skipped(
    tmp_path: Path,
) -> None:
    no_workers: dict[str, Any] = {"spec": {"gym": {"replicas": 2}}}
    workers: dict[str, Any] = {"spec": {"workers": {"replicas": 2}}}
    every = frozenset({"trainer", "gym", "worker"})
    assert roles_without_pods(no_workers, every) == ["worker"]
    assert roles_without_pods(workers, every) == []
    assert roles_without_pods(no_workers, frozenset({"gym"})) == []
    command = [sys.executable, "-m", "rolloutrun_runtime.cli", "run"]
    example = str(ROOT / "examples" / "tiny-grpo.yaml")
    only = [example, "--preempt-every", "5", "--preempt-roles", "worker"]
    result = subprocess.run(
        [*command, *only, "--work-dir", str(tmp_path / "run")], capture_output=True, text=True
    )
    assert result.returncode == 2  # refused before any cluster starts
    assert "tiny-grpo has no worker pods (spec.workers.replicas is 0)" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_the_api_server_would_refuse_is_named_before_a_cluster_starts(
    tmp_path: Path,
) -> None:
    """It printed the Kubernetes client's traceback (HTTP headers and body) after starting a
    cluster; now the offline check of ``rolloutrun validate`` on the run as applied."""
    bad = tmp_path / "bad.yaml"
    example = (ROOT / "examples" / "tiny-grpo.yaml").read_text()
    bad.write_text(example.replace("maxSteps: 30", "maxSteps: -3"))
    assert "maxSteps: -3" in bad.read_text()
    command = [sys.executable, "-m", "rolloutrun_runtime.cli", "run", str(bad)]
    result = subprocess.run(
        [*command, "--work-dir", str(tmp_path / "run")], capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"rolloutrun run: {bad}: invalid RolloutRun",
        "  spec.run.grpo.maxSteps: -3 is less than the minimum of 1",
    ]
    assert not (tmp_path / "run").exists()


def test_a_refusal_by_the_api_server_is_its_status_message() -> None:
    from kubernetes.client.exceptions import ApiException

    refused = ApiException(status=422, reason="Unprocessable Entity")
    refused.body = json.dumps({"kind": "Status", "message": 'RolloutRun "x" is invalid: spec'})
    assert api_message(refused) == 'RolloutRun "x" is invalid: spec'
    assert api_message(ApiException(status=409, reason="Conflict")) == "409 Conflict"

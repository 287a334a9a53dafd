"""The operator's metrics (scraped over HTTP) and its ``rolloutrun operator`` command."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rolloutrun_operator.api.v1alpha1 import RolloutRunStatus
from rolloutrun_operator.metrics import Metrics
from rolloutrun_runtime.cli import build_parser


def status(**fields) -> RolloutRunStatus:
    return RolloutRunStatus.model_validate(fields)


READY = [
    {"type": "Ready", "status": "True", "reason": "Running"},
    {"type": "Progressing", "status": "True", "reason": "Training"},
]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_runs_by_condition_restarts_and_latency_are_served():
    metrics = Metrics()
    port = metrics.serve(0, "127.0.0.1")
    try:
        metrics.record_run("ns", "a", None, status(conditions=READY))
        metrics.record_run("ns", "b", None, status(conditions=READY[:1]))
        restarted = status(
            conditions=[{"type": "Restarting", "status": "True", "reason": "TrainerFailed"}],
            restarts=1,
            lastFailure={"reason": "TrainerFailed"},
        )
        metrics.record_run("ns", "b", status(conditions=READY[:1]), restarted)
        preempted = restarted.model_copy(update={"preemptions": 2})
        metrics.record_run("ns", "b", restarted, preempted)
        metrics.reconcile_seconds.observe(0.02)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
            seen = samples(answer.read().decode())
    finally:
        metrics.close()
    assert seen[("rolloutrun_runs", (("condition", "Ready"),))] == 1
    assert seen[("rolloutrun_runs", (("condition", "Progressing"),))] == 1
    assert seen[("rolloutrun_runs", (("condition", "Restarting"),))] == 1
    assert seen[("rolloutrun_runs", (("condition", "Failed"),))] == 0
    key = ("rolloutrun_restarts_total", (("kind", "failure"), ("reason", "TrainerFailed")))
    assert seen[key] == 1
    key = ("rolloutrun_restarts_total", (("kind", "preemption"), ("reason", "TrainerFailed")))
    assert seen[key] == 2
    assert seen[("rolloutrun_reconcile_duration_seconds_count", ())] == 1
    metrics.forget_run("ns", "b")
    assert metrics.runs.labels(condition="Restarting")._value.get() == 0


def test_the_operator_command_is_registered_with_its_options():
    args = build_parser().parse_args(
        [
            "operator",
            "-n",
            "a",
            "-n",
            "b",
            "--peering",
            "p",
            "--priority",
            "5",
            "--metrics-port",
            "0",
        ]
    )
    assert args.namespace == ["a", "b"] and args.peering == "p" and args.priority == 5
    assert args.metrics_port == 0 and callable(args.handler)
    out = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "operator" in out and "Run the RolloutRun operator" in out

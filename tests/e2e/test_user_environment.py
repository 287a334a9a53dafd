"""``rolloutrun run`` with a user's environment server: spec.gym.command under the operator.

The example's own RolloutRun (examples/envs/times_table/times-table.yaml) runs on the local
cluster: its Gym pods run the example server (``python -m examples.envs.times_table.server``,
bound to ``$(POD_IP):$(ROLLOUTRUN_GYM_PORT)``), the trainer reads the prompt file from the
run's storage and trains to the end; its trainer pod deleted mid-run, the next incarnation
reads the prompt set again, resumes the cursor, and the audit of the durable state holds.
Asked for turn-level recovery, the trainer finds no checkpoint control plane on those
servers and says it recovers at sibling level.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from rolloutrun_localcluster.testing import eventually
from tests.e2e.conftest import finish, run_starts, wait_for_snapshot

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "envs" / "times_table"
MAX_STEPS = 6


@pytest.mark.chaos  # minutes on two cores: `make chaos` (the default suite stays under 15 min)
def test_the_example_environment_runs_under_the_operator(start_run, tmp_path, monkeypatch):
    # As the example's header runs it (`PYTHONPATH=$PWD rolloutrun run ...`): its Gym pods
    # import `examples.envs.times_table.server` from the repository root, whatever the
    # environment pytest was started in (`make chaos` sets no PYTHONPATH).
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))
    document = yaml.safe_load((EXAMPLE / "times-table.yaml").read_text())
    run_spec = document["spec"]["run"]
    run_spec["grpo"]["maxSteps"] = MAX_STEPS
    run_spec["checkpointing"].update(targetLevel="turn", snapshotIntervalSeconds=1)
    document["spec"]["recovery"]["backoffSeconds"] = 0
    # The prompt file goes into the run's storage first, as the example's header says.
    data = tmp_path / "run0" / "storage" / "data"
    data.mkdir(parents=True)
    shutil.copy(EXAMPLE / "prompts.jsonl", data / "times_table.jsonl")
    run = start_run(document)
    gym = eventually(lambda: run.pods().get("times-table-i1-gym-0"), timeout=120, what="a Gym pod")
    assert gym.spec.containers[0].command == document["spec"]["gym"]["command"]
    # A preemption: the next incarnation reads the prompt set again and resumes its cursor.
    wait_for_snapshot(run)
    run.delete_pod("times-table-i1-trainer")
    summary = finish(run)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS and summary["incarnations"] >= 2
    assert any(start["resumed_from"] for start in run_starts(run)[1:])
    # Every drawn prompt trained once or accounted for, from durable state.
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert run.cluster is not None
    trainer_dir = run.cluster.pod_dir("default", "times-table-i2-trainer")
    assert trainer_dir is not None
    trainer_log = (trainer_dir / "logs" / "trainer.log").read_text()
    assert "prompt set " in trainer_log and ": 64 prompts" in trainer_log
    assert "recovers at sibling level" in trainer_log
    trace = [json.loads(line) for line in (run.log_dir / "rollout_trace.jsonl").open()]
    lowered = [event for event in trace if event["event"] == "recovery_level_lowered"]
    assert len(lowered) >= 2  # said by every incarnation
    assert all(e["requested"] == "turn" and e["level"] == "sibling" for e in lowered)

"""``rolloutrun run`` with a user's environment server: spec.gym.command under the operator.

The example's own RolloutRun (examples/envs/times_table/times-table.yaml) runs on the local
cluster: its Gym pods run the example server (``python -m examples.envs.times_table.server``,
bound to ``$(POD_IP):$(ROLLOUTRUN_GYM_PORT)``), the trainer reads the prompt file from the
run's storage and trains to the end. Asked for turn-level recovery, the trainer finds no
checkpoint control plane on those servers and says it recovers at sibling level.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from rolloutrun_localcluster.testing import eventually
from tests.e2e.conftest import finish

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "envs" / "times_table"


def test_the_example_environment_runs_under_the_operator(start_run, tmp_path):
    document = yaml.safe_load((EXAMPLE / "times-table.yaml").read_text())
    run_spec = document["spec"]["run"]
    run_spec["grpo"]["maxSteps"] = 3
    run_spec["checkpointing"]["targetLevel"] = "turn"
    # The prompt file goes into the run's storage first, as the example's header says.
    data = tmp_path / "run0" / "storage" / "data"
    data.mkdir(parents=True)
    shutil.copy(EXAMPLE / "prompts.jsonl", data / "times_table.jsonl")
    run = start_run(document)
    gym = eventually(lambda: run.pods().get("times-table-i1-gym-0"), timeout=120, what="a Gym pod")
    assert gym.spec.containers[0].command == document["spec"]["gym"]["command"]
    summary = finish(run)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == 3
    assert run.cluster is not None
    trainer_dir = run.cluster.pod_dir("default", "times-table-i1-trainer")
    assert trainer_dir is not None
    trainer_log = (trainer_dir / "logs" / "trainer.log").read_text()
    assert "prompt set " in trainer_log and ": 64 prompts" in trainer_log
    assert "recovers at sibling level" in trainer_log
    trace = [json.loads(line) for line in (run.log_dir / "rollout_trace.jsonl").open()]
    lowered = [event for event in trace if event["event"] == "recovery_level_lowered"]
    assert lowered and all(e["requested"] == "turn" and e["level"] == "sibling" for e in lowered)

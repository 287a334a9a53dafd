"""The trainer against a user's environment server, through the HTTP contract alone.

The server is ``examples/envs/times_table/server.py``, run as its own process: it imports
the contract's wire models and nothing of the built-in Gym (checked on its source). Its
prompts are the example's rows written as Parquet into ``gs://`` (the GCS emulator); the
trainer reads them through ``task.dataset`` and sends each row in ``/run``. The server has
no checkpoint control plane, so a run asking for turn-level recovery recovers at sibling
level and says so.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.trainer import run_trainer
from tests.support.cli import train_command
from tests.support.gcs_emulator import FakeGcs
from tests.support.run_configs import tiny_config
from tests.support.storage_params import BUCKET

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "envs" / "times_table"
SERVER = EXAMPLE / "server.py"
MAX_SEQ_LEN = 32


def start_server(token: str) -> tuple[subprocess.Popen[str], str]:
    """One replica of the example on a free loopback port; its URL from the READY line."""
    env = {**os.environ, ENV_GYM_TOKEN: token}
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", "--max-seq-len", str(MAX_SEQ_LEN)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("READY "):
        process.kill()
        raise AssertionError(f"the example server did not start: {line!r}")
    return process, line.split()[1]


@pytest.fixture
def servers(data_plane_token: str) -> Iterator[list[str]]:
    started = [start_server(data_plane_token) for _ in range(2)]
    yield [url for _, url in started]
    for process, _ in started:
        process.terminate()
        process.wait(timeout=10)


def parquet_prompts(fake_gcs: FakeGcs) -> str:
    """The example's rows, as Parquet in the emulator's bucket; returns the gs:// URI."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    name = f"t-{uuid.uuid4().hex[:12]}/prompts.parquet"
    fake_gcs.client().bucket(BUCKET).blob(name).upload_from_string(sink.getvalue())
    return f"gs://{BUCKET}/{name}"


def test_the_example_server_uses_the_contract_not_the_built_in_gym() -> None:
    tree = ast.parse(SERVER.read_text())
    imported = {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    ours = {name for name in imported if name.startswith("rolloutrun_runtime")}
    assert ours == {
        "rolloutrun_runtime.contract.wire",
        "rolloutrun_runtime.contract.pod",
        "rolloutrun_runtime.policy.tokenizer",
    }


def test_the_trainer_runs_against_the_example_through_the_contract(
    tmp_path: Path,
    servers: list[str],
    fake_gcs: FakeGcs,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)  # the trainer's own gs:// client
    uri = parquet_prompts(fake_gcs)
    cfg = tiny_config(
        tmp_path,
        policy={"maxSeqLen": MAX_SEQ_LEN},
        task={
            "name": "external",
            "maxNewTokens": 3,
            "dataset": {
                "uri": uri,
                "promptField": "question",
                "answerField": "product",
                "metadataFields": ["a", "b"],
            },
        },
        grpo={"maxSteps": 2, "promptsPerStep": 2, "groupSize": 4},
        checkpointing={"targetLevel": "turn", "snapshotIntervalSeconds": 0},
        gym={"replicas": 2, "endpoints": servers},
    )
    caplog.set_level(logging.INFO, logger="rolloutrun_runtime.trainer_inputs")
    result = asyncio.run(asyncio.wait_for(run_trainer(cfg), 240))
    assert result.steps == 2
    # No control plane on the example: sibling level, said in the result and the log.
    assert result.recovery_level == "sibling"
    assert any("recovers at sibling level" in r.getMessage() for r in caplog.records)
    assert any(f"prompt set {uri}: 64 prompts" in r.getMessage() for r in caplog.records)
    trace = [json.loads(line) for line in (tmp_path / "run" / "rollout_trace.jsonl").open()]
    (lowered,) = [event for event in trace if event["event"] == "recovery_level_lowered"]
    assert (lowered["requested"], lowered["level"]) == ("turn", "sibling")
    # Prompt ids are rows of the Parquet file (64), not the config's datasetSize (96).
    assert result.trained_prompt_ids and max(result.trained_prompt_ids) < 64
    rewards = [step["reward_mean"] for step in result.history if "reward_mean" in step]
    assert len(rewards) == 2 and all(0.0 <= reward <= 1.0 for reward in rewards)
    # The next incarnation, still asking for turn level, resumes what this one recorded at
    # the level it settled on (it plans its restore before its Gyms answer).
    more = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"max_steps": 3})})
    resumed = asyncio.run(asyncio.wait_for(run_trainer(more), 240))
    assert resumed.resumed_from is not None and resumed.steps == 3
    assert resumed.recovery_level == "sibling"


def test_rolloutrun_train_runs_the_users_server_from_spec_gym_command(tmp_path: Path) -> None:
    """Without a cluster, ``rolloutrun train`` starts ``spec.gym.command`` as the replicas
    (``$(POD_IP)``/``$(ROLLOUTRUN_GYM_PORT)`` expanded) and waits for their ``/healthz``."""
    document = yaml.safe_load((EXAMPLE / "times-table.yaml").read_text())
    document["spec"]["run"]["grpo"]["maxSteps"] = 1
    document["spec"]["run"]["task"]["dataset"]["uri"] = str(EXAMPLE / "prompts.jsonl")
    document["spec"]["gym"]["command"][0] = sys.executable
    path = tmp_path / "times-table.yaml"
    path.write_text(yaml.safe_dump(document))
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [*train_command(path, tmp_path / "run"), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath},
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done: step 1" in done.stdout
    for index in range(2):
        assert "READY http://127.0.0.1:" in (tmp_path / "run" / f"gym-{index}.log").read_text()

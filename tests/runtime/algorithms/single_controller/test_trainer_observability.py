"""What users watch outlives the trainer pod: per-step log lines, the metrics and the trace
in the run's storage, the Prometheus endpoint, and the audit and trace commands given the
storage alone.

Two incarnations of the real trainer (in process, real Gym servers on loopback) share one
storage and each gets its own log directory, deleted after it ends, as a pod's emptyDir is:
every later check reads only the storage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutrun_runtime.algorithms.single_controller.hooks import NoHooks
from rolloutrun_runtime.cli import main as rolloutrun
from rolloutrun_runtime.contract.pod import (
    ENV_INCARNATION,
    ENV_METRICS_PORT,
    ENV_METRICS_TOKEN,
    ENV_POD_IP,
)
from rolloutrun_runtime.metrics import format_step_line
from rolloutrun_runtime.policy.http import bearer_headers
from rolloutrun_runtime.run_logs import read_stored_metrics
from rolloutrun_runtime.storage import open_storage
from rolloutrun_runtime.trainer import _run_until_signalled, run_trainer
from tests.support.data_plane import HEADERS
from tests.support.run_configs import tiny_config

RUN_LIMIT_S = 150
STEPS = 4
PREEMPTED_AT = 2
METRICS_TOKEN = "test-metrics-token"


def _config(tmp_path: Path, storage: Path, log_dir: str) -> Any:
    cfg = tiny_config(
        tmp_path,
        grpo={"maxSteps": STEPS},
        checkpointing={"storageUri": f"file://{storage}", "snapshotIntervalSeconds": 0},
    )
    return cfg.model_copy(update={"log_dir": str(tmp_path / log_dir)})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Scrape(NoHooks):
    """At ``at_step``, scrape the trainer's ``/metrics`` from its own event loop."""

    def __init__(self, port: int, at_step: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.at_step = at_step
        self.task: asyncio.Task[str] | None = None

    def on_step(self, record: dict[str, Any]) -> None:
        if record["step"] == self.at_step:
            self.task = asyncio.ensure_future(self._get())

    async def _get(self) -> str:
        # at once (the server stops with the run): no token and the run's data-plane token
        # get 401, the metrics token gets the metrics
        async with aiohttp.ClientSession() as session:
            no_token, data_plane, text = await asyncio.gather(
                self._one(session, {}),
                self._one(session, HEADERS),
                self._one(session, bearer_headers(METRICS_TOKEN)),
            )
        assert no_token == data_plane == "401"
        return text

    async def _one(self, session: aiohttp.ClientSession, headers: dict[str, str]) -> str:
        async with session.get(self.url, headers=headers) as response:
            if response.status != 200:
                return str(response.status)
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return await response.text()


class _PreemptAt(NoHooks):
    def __init__(self, event: asyncio.Event, step: int) -> None:
        self.event, self.step = event, step

    def on_step(self, record: dict[str, Any]) -> None:
        if record["step"] == self.step:
            self.event.set()


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_logs_metrics_trace_and_audit_outlive_each_pod(
    tmp_path, gym_endpoints, monkeypatch, capsys
):
    storage = tmp_path / "storage"
    # Incarnation 0: preempted (forced snapshot, stop) after step 2; its log dir then goes.
    monkeypatch.setenv(ENV_INCARNATION, "0")
    first = await gym_endpoints(_config(tmp_path, storage, "pod-0"))
    preemption = asyncio.Event()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(
            run_trainer(first, hooks=_PreemptAt(preemption, PREEMPTED_AT), preemption=preemption),
            RUN_LIMIT_S,
        )
    shutil.rmtree(first.log_dir)

    # Incarnation 1, serving /metrics on loopback: resumes, finishes; its log dir goes too.
    port = _free_port()
    monkeypatch.setenv(ENV_INCARNATION, "1")
    monkeypatch.setenv(ENV_METRICS_PORT, str(port))
    monkeypatch.setenv(ENV_METRICS_TOKEN, METRICS_TOKEN)
    monkeypatch.setenv(ENV_POD_IP, "127.0.0.1")
    second = await gym_endpoints(_config(tmp_path, storage, "pod-1"))
    scrape = _Scrape(port, STEPS)
    result = await asyncio.wait_for(run_trainer(second, hooks=scrape), RUN_LIMIT_S)
    assert result.resumed_from is not None
    shutil.rmtree(second.log_dir)

    # The metrics of both incarnations, from the storage alone.
    rows = read_stored_metrics(open_storage(f"file://{storage}"))
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["weight_version"] for row in rows] == list(range(1, STEPS + 1))

    # The Prometheus endpoint, scraped during the last step and parsed.
    assert scrape.task is not None and scrape.task.done()
    samples = _samples(scrape.task.result())
    assert samples["rolloutrun_trainer_step"] == STEPS
    assert samples["rolloutrun_trainer_incarnation"] == 1
    assert samples["rolloutrun_trainer_last_reward"] == pytest.approx(rows[-1]["reward_mean"])
    assert samples["rolloutrun_trainer_thrown_away_seconds_total"] >= 0
    assert samples["rolloutrun_trainer_pump_paused_seconds_total"] >= 0
    assert samples["process_resident_memory_bytes"] > 0

    # `rolloutrun trace URI`: both incarnations' trace segments, one stop between them.
    assert rolloutrun(["trace", f"file://{storage}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["runs"]) == 2 and len(report["stops"]) == 1
    assert report["stops"][0]["restored_snapshot_id"] is not None
    assert samples["rolloutrun_trainer_thrown_away_seconds_total"] == pytest.approx(
        report["thrown_away_s_total"]
    )

    # `rolloutrun audit URI`: the storage alone (the config the trainer kept gives the seed).
    assert rolloutrun(["audit", f"file://{storage}", "--json"]) == 0
    audit = json.loads(capsys.readouterr().out)
    assert audit["ok"] and audit["step"] == STEPS and audit["max_steps"] == STEPS


async def test_the_trainer_pod_logs_one_line_per_step(tmp_path, gym_endpoints, caplog):
    cfg = await gym_endpoints(_config(tmp_path, tmp_path / "storage", "pod"))
    with caplog.at_level(logging.INFO, logger="rolloutrun_runtime.trainer"):
        assert await asyncio.wait_for(_run_until_signalled(cfg), RUN_LIMIT_S) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
    assert [line.split()[0] for line in lines] == [f"step={n}/{STEPS}" for n in range(1, 5)]
    for number, line in enumerate(lines, 1):
        fields = dict(field.split("=", 1) for field in line.split())
        assert set(fields) == {
            "step",
            "reward",
            "loss",
            "step_time",
            "weight_version",
            "snapshot_age",
        }
        assert fields["weight_version"] == str(number)
        float(fields["reward"]), float(fields["loss"])
        assert fields["snapshot_age"] == "none"  # periodic snapshots off: none published


def test_a_step_line_gives_the_newest_snapshot_age_in_seconds():
    record = {"step": 7, "reward_mean": 0.5, "loss": -0.25, "step_time_s": 1.5}
    line = format_step_line({**record, "weight_version": 7}, 10, 3.44)
    assert line == (
        "step=7/10 reward=0.5000 loss=-0.2500 step_time=1.50s weight_version=7 snapshot_age=3.4s"
    )
    assert "reward=nan" in format_step_line({**record, "reward_mean": float("nan")}, 10, None)

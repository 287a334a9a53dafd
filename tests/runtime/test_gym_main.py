"""``rolloutrun gym`` refuses a run whose environment is the user's own server, and says what
its start-up cost when it listens."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from rolloutrun_runtime import gym_main
from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.run_config import UNRESTORABLE_EXIT_CODE
from rolloutrun_runtime.gym_main import startup_cost


def test_the_built_in_gym_refuses_the_external_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("task: {name: external}\n")
    parser = argparse.ArgumentParser()
    gym_main.register(parser)
    args = parser.parse_args(["--config", str(config), "--port", "0", "--instance-id", "g-0"])
    assert gym_main.run(args) == 2
    assert "user's own environment server (spec.gym.command" in capsys.readouterr().err


def _gym_args(tmp_path: Path, model: Path) -> argparse.Namespace:
    config = tmp_path / "run.yaml"
    config.write_text(f"policy: {{model: {model}}}\n")
    parser = argparse.ArgumentParser()
    gym_main.register(parser)
    return parser.parse_args(["--config", str(config), "--port", "0", "--instance-id", "g-0"])


def _incomplete(directory: Path) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


def _garbled_tokenizer(directory: Path) -> Path:
    _incomplete(directory)
    (directory / "model.safetensors").write_bytes(b"x")
    (directory / "tokenizer.json").write_text("not json")
    return directory


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda d: d, "is not a directory"),
        (_incomplete, "lacks tokenizer.json"),
        (_garbled_tokenizer, "tokenizer.json: not a readable tokenizer"),
    ],
    ids=["missing", "incomplete", "garbled tokenizer"],
)
def test_a_gym_without_its_model_stops_with_one_named_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch, make, named
) -> None:
    monkeypatch.setenv(ENV_GYM_TOKEN, "t")  # as in its pod: the model is what is wrong
    model = make(tmp_path / "tiny-hf-model")
    assert gym_main.run(_gym_args(tmp_path, model)) == UNRESTORABLE_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("rolloutrun gym: ") and str(model) in err and named in err


def test_the_start_up_cost_is_the_cpu_so_far_and_the_seconds_since_the_fork() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    stat = f"4242 (rolloutrun gym) S {' '.join(['0'] * 18)} {100 * ticks} 0 0"  # starttime 100 s
    cpu, since = startup_cost(stat, now_s=102.5)
    assert since == pytest.approx(2.5)
    assert cpu == pytest.approx(sum(os.times()[:2]), abs=0.5)
    assert startup_cost("not a stat line", now_s=1.0)[1] is None

"""``rolloutrun gym`` refuses a run whose environment is the user's own server."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rolloutrun_runtime import gym_main


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

"""Issue 12: the Gym token reaches the Gym's and the trainer's control code, no child process.

Every process inherits its parent's environment: a token left in ``os.environ`` reaches each
tool a Gym task runs and each worker the trainer starts, and any of them could drive the
Gym's control plane (drop a restore, retire episodes). The entry points take the token out
of their environment at startup and hand it on as an argument. Checked on the real entry
points: a Gym replica (``rolloutrun gym``) that runs a child process after startup, the
trainer's pod entry point, and ``rolloutrun train`` (the launcher and the local trainer),
whose turn-level run needs the token in both the Gyms and the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from tests.support.run_configs import tiny_config

ROOT = Path(__file__).resolve().parents[2]

#: Run in a child of the process under test: prints what that process would hand a tool.
SHOW_TOKEN = f"import os; print(os.environ.get({ENV_GYM_TOKEN!r}, '<unset>'))"

#: ``rolloutrun gym`` as is, plus a thread that acts as a tool once the replica serves: it
#: runs a child process, checks that the control plane still takes the token, and stops.
GYM_WITH_A_TOOL = """
import json, os, signal, subprocess, sys, threading, time, urllib.request
from rolloutrun_runtime.cli import main

port, out, config, status_route = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
token = os.environ[{env!r}]  # the test's copy, read before the replica starts

def tool():
    base = f"http://127.0.0.1:{{port}}"
    while True:
        try:
            urllib.request.urlopen(base + "/healthz", timeout=1).read()
            break
        except OSError:
            time.sleep(0.05)
    child = subprocess.run([sys.executable, "-c", {show!r}], capture_output=True, text=True)
    status = urllib.request.Request(
        base + status_route, headers={{"Authorization": "Bearer " + token}}
    )
    with urllib.request.urlopen(status, timeout=5) as response:
        answered = response.status
    with open(out, "w") as handle:
        json.dump({{"child": child.stdout.strip(), "control": answered}}, handle)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=tool, daemon=True).start()
sys.exit(main(["--log-level", "WARNING", "gym", "--config", config, "--port", str(port)]))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _child_sees() -> str:
    done = subprocess.run([sys.executable, "-c", SHOW_TOKEN], capture_output=True, text=True)
    return done.stdout.strip()


def test_a_gym_replicas_child_process_does_not_see_the_token(tmp_path: Path) -> None:
    from rolloutrun_runtime.contract.wire import control_route

    config = tmp_path / "gym.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path).to_yaml_dict()))
    script = tmp_path / "gym_with_a_tool.py"
    script.write_text(GYM_WITH_A_TOOL.format(env=ENV_GYM_TOKEN, show=SHOW_TOKEN))
    out = tmp_path / "seen.json"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(_free_port()),
            str(out),
            str(config),
            control_route("status"),
        ],
        env={**os.environ, ENV_GYM_TOKEN: "gym-secret"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(out.read_text())
    assert seen == {"child": "<unset>", "control": 200}


def test_the_trainer_entry_point_takes_the_token_out_of_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutrun_runtime.trainer import main

    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path).to_yaml_dict()))
    monkeypatch.setenv(ENV_GYM_TOKEN, "trainer-secret")
    # No gym.endpoints: the entry point stops right after startup (exit 2).
    assert main(argparse.Namespace(config=str(config), log_dir=None)) == 2
    assert ENV_GYM_TOKEN not in os.environ
    assert _child_sees() == "<unset>"


def test_rolloutrun_train_hands_the_token_to_its_gyms_and_trainer_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutrun_runtime.launcher import main
    from rolloutrun_runtime.metrics import read_metrics

    cfg = tiny_config(
        tmp_path,
        grpo={"maxSteps": 2},
        gym={"replicas": 1},
        checkpointing={"targetLevel": "turn", "savePeriod": 2},
        task={"name": "reach_target", "maxOperand": 9, "maxTurns": 4, "maxNewTokens": 3},
        policy={"maxSeqLen": 64},
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.to_yaml_dict()))
    monkeypatch.delenv(ENV_GYM_TOKEN, raising=False)
    log_dir = tmp_path / "run"
    args = argparse.Namespace(file=str(config), log_dir=str(log_dir), quiet=True, verbose=False)
    # Turn level: the trainer refuses to start without the token, the Gyms' control plane
    # answers 403 without it; the run finishing proves both got it.
    assert main(args) == 0
    assert [r["step"] for r in read_metrics(log_dir)] == [1, 2]
    assert ENV_GYM_TOKEN not in os.environ
    assert _child_sees() == "<unset>"

"""``rolloutrun train`` stops its Gym replicas when interrupted (Ctrl-C) or done."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.support.cli import quiet_rolloutrun, reaped, train_command

ROOT = Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline = _cmdline(int(entry.name))
        if text in cmdline and "train" not in cmdline.split():
            found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    """A process's argv joined by spaces ("" once it is gone)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_gym_replicas(tmp_path: Path) -> None:
    log_dir = tmp_path / "interrupted"
    # The example's 30 steps can all train between the first step line and the signal on a
    # fast run; a run that cannot end first makes the exit code the interrupt's.
    document = yaml.safe_load((ROOT / "examples" / "tiny-multiturn.yaml").read_text())
    document["spec"]["run"]["grpo"]["maxSteps"] = 100_000
    config = tmp_path / "tiny-multiturn-long.yaml"
    config.write_text(yaml.safe_dump(document))
    with reaped(
        subprocess.Popen(
            train_command(config, log_dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=tmp_path,
            # Ctrl-C in a terminal: SIGINT at its default, even when this test runs as a
            # background job of a shell without job control (which starts it ignored).
            preexec_fn=_sigint_default,
        )
    ) as process:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step "):
                break
        assert any(line.startswith("step ") for line in lines), lines
        running = [_cmdline(pid).split() for pid in _processes_mentioning(str(log_dir))]
        assert sum("gym" in argv for argv in running) == 2  # the two Gym replicas
        # (and the trainer's snapshot writer, its argv naming the run's storage under log_dir)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(log_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(log_dir)) == []


def test_trainer_pod_entry_point_runs_against_given_gym_endpoints(tmp_path: Path) -> None:
    import yaml

    from rolloutrun_runtime.launcher import start_gym, stop_process
    from rolloutrun_runtime.metrics import read_metrics
    from tests.support.run_configs import tiny_config

    cfg = tiny_config(
        tmp_path, grpo={"maxSteps": 2}, gym={"replicas": 1}, checkpointing={"savePeriod": 2}
    )
    gym_file = tmp_path / "gym.yaml"
    gym_file.write_text(yaml.safe_dump(cfg.to_yaml_dict()))
    gym = start_gym(gym_file, tmp_path, 0)
    try:
        with_endpoints = cfg.model_copy(
            update={"gym": cfg.gym.model_copy(update={"endpoints": [gym.url]})}
        )
        trainer_file = tmp_path / "trainer.yaml"
        trainer_file.write_text(yaml.safe_dump(with_endpoints.to_yaml_dict()))
        command = quiet_rolloutrun()
        log_dir = tmp_path / "pod"
        done = subprocess.run(
            [*command, "trainer", "--config", str(trainer_file), "--log-dir", str(log_dir)],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert [r["step"] for r in read_metrics(log_dir)] == [1, 2]
        assert (log_dir / "checkpoints" / "step_2" / "COMMITTED").exists()
        refused = subprocess.run(
            [*command, "trainer", "--config", str(gym_file)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "gym.endpoints is empty" in refused.stderr

        # SIGTERM (the pod being stopped) ends the trainer cleanly with 128 + SIGTERM.
        long_run = with_endpoints.model_copy(
            update={"grpo": with_endpoints.grpo.model_copy(update={"max_steps": 10_000})}
        )
        long_file = tmp_path / "long.yaml"
        long_file.write_text(yaml.safe_dump(long_run.to_yaml_dict()))
        stopped_dir = tmp_path / "stopped"
        trainer = subprocess.Popen(
            [*command, "trainer", "--config", str(long_file), "--log-dir", str(stopped_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            while not read_metrics(stopped_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert read_metrics(stopped_dir), "the trainer never finished a step"
            trainer.send_signal(signal.SIGTERM)
            assert trainer.wait(timeout=60) == 128 + signal.SIGTERM
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    finally:
        stop_process(gym.process)
        gym.log.close()

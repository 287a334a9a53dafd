"""``rolloutrun train`` stops its Gym replicas when interrupted (Ctrl-C) or done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and "train" not in cmdline.split():
            found.append(int(entry.name))
    return found


def test_ctrl_c_stops_the_gym_replicas(tmp_path: Path) -> None:
    log_dir = tmp_path / "interrupted"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutrun_runtime.cli",
            "--log-level",
            "WARNING",
            "train",
            str(ROOT / "examples" / "tiny-multiturn.yaml"),
            "--log-dir",
            str(log_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    assert process.stdout is not None
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step "):
                break
        assert any(line.startswith("step ") for line in lines), lines
        assert len(_processes_mentioning(str(log_dir))) == 2  # the two Gym replicas
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(log_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(log_dir)) == []

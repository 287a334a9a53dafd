"""Child process for the file:// crash tests: publishes entries until it is SIGKILLed.

Usage: ``crash_publisher.py ROOT loop`` publishes ``snaps/step_<n>`` for n = 0, 1, ... and
prints ``n`` after each commit; ``crash_publisher.py ROOT fifo FIFO`` publishes one entry
whose second file is read from the named pipe FIFO (the test holds it open to freeze the
publisher mid-file).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from rolloutrun_runtime.storage import (
    CheckpointStorage,
    list_committed,
    open_storage,
    publish_entry,
)

FILES = 3
REPO = Path(__file__).resolve().parents[2]


def content(step: int, index: int) -> bytes:
    """Deterministic content of file ``index`` of entry ``step``; sizes vary up to ~1 MiB."""
    seed = hashlib.sha256(f"{step}/{index}".encode()).digest()
    return seed * (1 + (seed[0] * 4096 + seed[1] * 16) // 32)


def spawn(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start this script as a child process (for the tests)."""
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = f"{REPO / 'runtime'}{os.pathsep}{REPO}"
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
    )


def kill_after_commits(root: str, commits: int, env: Mapping[str, str] | None = None) -> None:
    """Run the looping publisher on ``root`` and SIGKILL it right after ``commits`` commits,
    i.e. somewhere inside publishing the next entry."""
    proc = spawn(root, "loop", env=env)
    assert proc.stdout is not None and proc.stderr is not None
    with proc.stdout, proc.stderr:
        seen = [proc.stdout.readline() for _ in range(commits)]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if seen != [f"{n}\n" for n in range(commits)]:
            raise AssertionError(f"publisher said {seen!r}; stderr: {proc.stderr.read()}")
    assert proc.returncode == -signal.SIGKILL


def check_committed_whole(storage: CheckpointStorage) -> list[int]:
    """Every committed entry has all its files with the right content, and the committed
    steps are 0..n without gaps; return them."""
    steps = sorted(int(e.rsplit("_", 1)[1]) for e in list_committed(storage, "snaps"))
    assert steps == list(range(len(steps))), steps
    for step in steps:
        for i in range(FILES):
            assert storage.read_bytes(f"snaps/step_{step}/f{i}") == content(step, i)
    return steps


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    storage = open_storage(root)
    if mode == "loop":
        step = 0
        while True:
            publish_entry(
                storage, f"snaps/step_{step}", {f"f{i}": content(step, i) for i in range(FILES)}
            )
            print(step, flush=True)
            step += 1
    elif mode == "fifo":
        publish_entry(
            storage,
            "snaps/step_0",
            {"a": content(0, 0), "b": Path(sys.argv[3]), "c": content(0, 2)},
        )
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()

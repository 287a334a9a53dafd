"""The ``rolloutrun`` command line as the tests start it in a child process: one spelling of
the interpreter, the module and the quiet log level, and one way to leave no child behind,
so a test says only what it runs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: ``rolloutrun`` as a child process of the test's interpreter.
ROLLOUTRUN = [sys.executable, "-m", "rolloutrun_runtime.cli"]


def quiet_rolloutrun(*args: str) -> list[str]:
    """``rolloutrun --log-level WARNING ARGS...``."""
    return [*ROLLOUTRUN, "--log-level", "WARNING", *args]


def train_command(config: Path | str, log_dir: Path | str) -> list[str]:
    """``rolloutrun train CONFIG --log-dir LOG_DIR``, warnings and errors only."""
    return quiet_rolloutrun("train", str(config), "--log-dir", str(log_dir))


@contextlib.contextmanager
def reaped(process: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """``process``; on the way out killed and waited for if it still runs, its stdout closed."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

"""Run one bench module's measurement with another checkout's runtime: the side-by-side
benches measure a baseline tree in the same run, each in a fresh process whose last stdout
line is its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The bench package's own checkout (the module runs from here, the tree's runtime first).
HERE = Path(__file__).resolve().parent.parent


def run_in_tree(tree: Path, module: str, argv: list[str], timeout_s: float) -> Any:
    """``python -m <module> <argv>`` with ``tree``'s runtime and operator on the path; the
    parsed JSON of its last stdout line."""
    path = os.pathsep.join([str(HERE), str(tree / "runtime"), str(tree / "operator")])
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        env={**os.environ, "PYTHONPATH": path},
        cwd=HERE,
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return json.loads(done.stdout.splitlines()[-1])

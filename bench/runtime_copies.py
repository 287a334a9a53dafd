"""Copies of a checkout's ``runtime/`` for the local-cluster pods of a benchmark arm.

Why apart from the benches: the elastic, worker and Gym start-up benches compare this
tree's runtime with a baseline's side by side, and each arm's pods import the copy named on
their ``PYTHONPATH``; both copies are byte-compiled alike (the pods' root is read-only, so
a copy without ``__pycache__`` would compile every module at each pod start).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def pods_pythonpath(runtime: Path | None) -> dict[str, str]:
    """The environment the kubelet hands the pods (it reads ``PYTHONPATH`` at each start)."""
    if runtime is None:
        return {}
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(runtime), *([inherited] if inherited else [])])}


def runtime_at(ref: str, into: Path) -> Path:
    """A copy of ``runtime/`` at git ``ref``, or of the checkout at directory ``ref`` (its
    working tree: ``/tmp/base25``), byte-compiled, as the installed tree is."""
    if Path(ref).is_dir():
        return runtime_here(into, Path(ref))
    archive = subprocess.run(
        ["git", "archive", ref, "runtime"], check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(into / "runtime")], check=True)
    return into / "runtime"


def runtime_here(into: Path, tree: Path | None = None) -> Path:
    """A copy of this checkout's (or ``tree``'s) ``runtime/`` (its working tree),
    byte-compiled as :func:`runtime_at`'s is, so both sides of a comparison start alike."""
    root = tree if tree is not None else Path(__file__).resolve().parents[1]
    if not (root / "runtime" / "rolloutrun_runtime").is_dir():
        raise SystemExit(f"{root} is not a rolloutrun checkout (no runtime/rolloutrun_runtime)")
    shutil.copytree(
        root / "runtime", into / "runtime", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(into / "runtime")], check=True)
    return into / "runtime"

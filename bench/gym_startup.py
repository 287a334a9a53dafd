"""Gym pod start-up: ``rolloutrun gym`` process launch -> ``READY`` -> ``/healthz`` answering,
this checkout side by side with another git ref in one run, printed as JSON.

Why its own bench: a replaced Gym's start-up is most of a member replacement
(``bench/elastic.py``'s ``gym_listening`` stage); this isolates it. Each round launches one
fresh process per tree, the trees alternating, so both see the same machine load. Both
trees are copies of ``runtime/`` byte-compiled as an installed image is (a tree without
``__pycache__`` compiles every module at each start). Per tree: wall seconds to ``READY``
and to the first ``/healthz`` 200, and the process's CPU seconds (user + system, from
``/proc/<pid>/stat``) at ``READY``: what a shared machine inflates least.

Usage: ``python -m bench.gym_startup [--before main] [--rounds 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE

from .elastic import runtime_at, runtime_here

#: The Gym's run configuration: the elastic bench's task (``bench.operator_recovery``).
CONFIG = """\
seed: 5
policy: {dModel: 32, nLayers: 1, nHeads: 2, maxSeqLen: 32}
task: {name: arithmetic, datasetSize: 512, maxOperand: 9, maxNewTokens: 4}
grpo: {groupSize: 4, promptsPerStep: 4, maxSteps: 100000, maxStaleness: 1}
workers: {backend: inprocess}
"""
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def launch(runtime: Path, config: Path) -> dict[str, float]:
    """One ``rolloutrun gym`` start on ``runtime``'s tree: seconds to READY and /healthz."""
    env = dict(os.environ, PYTHONPATH=str(runtime), **{ENV_GYM_TOKEN: "bench-token"})
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    argv = [sys.executable, "-m", "rolloutrun_runtime.cli", "gym", "--config", str(config)]
    start = time.monotonic()
    process = subprocess.Popen(
        [*argv, "--port", "0", "--instance-id", "bench-gym"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        url = ""
        for line in process.stdout:
            if line.startswith("READY "):
                url = line.split()[1]
                break
        ready, cpu = time.monotonic() - start, cpu_seconds(process.pid)
        if not url:
            raise RuntimeError(f"the Gym on {runtime} exited before READY")
        while True:
            try:
                with urllib.request.urlopen(url + HEALTHZ_ROUTE, timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.005)
        return {"ready_s": ready, "healthz_s": time.monotonic() - start, "cpu_at_ready_s": cpu}
    finally:
        process.terminate()
        process.wait(timeout=30)


def summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    keys = ("ready_s", "healthz_s", "cpu_at_ready_s")
    return {
        key: {
            "p50": round(statistics.median(s[key] for s in samples), 3),
            "min": round(min(s[key] for s in samples), 3),
            "max": round(max(s[key] for s in samples), 3),
        }
        for key in keys
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="main", help="git ref to compare with")
    parser.add_argument("--rounds", type=int, default=10, help="starts per tree")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gym-startup-") as tmp:
        work = Path(tmp)
        config = work / "run.yaml"
        config.write_text(CONFIG)
        trees = {
            "this": runtime_here(work / "this"),
            args.before: runtime_at(args.before, work / "before"),
        }
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, runtime in trees.items():
                samples[name].append(launch(runtime, config))
    result = {name: summary(runs) for name, runs in samples.items()}
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[:3]
    print(json.dumps({"rounds": args.rounds, "loadavg": load, **result}, indent=1))


if __name__ == "__main__":
    main()

"""A worker pod's entry point imports what it runs, not the run's config models.

Every refill of a generation worker pod starts ``python -m rolloutrun_runtime.workers.ray_node``
on the node that also trains (on the local cluster: the same cores). Its job is to wait for
the GCS and run ``ray start``; importing the config's pydantic models cost it ~0.8 s of CPU
per pod start on a loaded machine, for nothing it uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
import rolloutrun_runtime.workers.ray_node
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {"pydantic", "torch", "ray"}
                        or m == "rolloutrun_runtime.contract.run_config")))
"""


def test_the_worker_node_entry_point_does_not_import_the_config_models() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=os.environ
    ).stdout
    assert json.loads(out) == []


def test_the_package_still_builds_workers_from_a_config() -> None:
    """``build_workers`` imports the backends' names when it is called."""
    from rolloutrun_runtime.workers import WorkerError, build_workers

    assert callable(build_workers) and issubclass(WorkerError, RuntimeError)

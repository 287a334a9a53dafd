"""``bench.worker_start_cpu`` labels each process of a worker node by its command line: the
placeholder for Ray's dashboard agent and the node's own start (``workers/ray_boot.py``) are
counted where Ray's agent and ``ray start`` were, so the two trees stay side by side."""

from __future__ import annotations

import sys

from bench.worker_start_cpu import label
from rolloutrun_runtime.workers import ray_agent_stub
from rolloutrun_runtime.workers.ray_node import worker_argv


def test_the_placeholder_agent_and_the_boot_module_are_labelled_as_rays() -> None:
    stub = f"{sys.executable} {ray_agent_stub.__file__} --node-id=ab --session-dir=/s"
    ray_agent = f"{sys.executable} /venv/site-packages/ray/dashboard/agent.py --node-id=ab"
    assert label(stub) == label(ray_agent) == "dashboard_agent"
    boot = " ".join(worker_argv("10.0.0.1:6379", "10.0.0.2", 1, None))
    ray_cli = f"{sys.executable} -m ray.scripts.scripts start --address=10.0.0.1:6379 --block"
    assert label(boot) == label(ray_cli) == "ray_start"
    assert label(f"{sys.executable} -m rolloutrun_runtime.workers.ray_node --slots=1") == "ray_node"

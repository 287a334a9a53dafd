"""A worker pod's Ray node runs placeholders for both of Ray's agents
(:mod:`rolloutrun_runtime.workers.ray_boot`): it still hosts a generation actor, and an actor
that asks it for a ``runtime_env`` fails at once, naming why, instead of hanging on an agent
that is not there (and the node's other actor keeps serving)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.ray_multinode import namespace_unavailable
from tests.support.ray_node_loss import WORKER_IP
from tests.support.ray_runtime_env_refused import run


@pytest.mark.timeout(600)  # a head and a worker node: ~8 s idle, more on a shared machine
@pytest.mark.skipif(namespace_unavailable() is not None, reason=str(namespace_unavailable()))
def test_a_worker_node_hosts_actors_and_refuses_a_runtime_env_by_name(tmp_path: Path) -> None:
    result = run(tmp_path, timeout_s=540)
    assert result["plain_actor_node_ip"] == WORKER_IP
    commands = result["node_processes"]
    assert any("--stub=runtime-env" in command for command in commands)
    assert any("--stub=dashboard" in command for command in commands)
    assert not any("runtime_env/agent/main.py" in command.split(" --")[0] for command in commands)
    assert not any("dashboard/agent.py" in command.split(" --")[0] for command in commands)
    assert "RuntimeEnvSetupError" in result["error"], result["error"]
    assert "no runtime-env agent runs here" in result["error"]
    assert result["plain_still_serves"]

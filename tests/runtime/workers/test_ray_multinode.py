"""A real multi-node Ray: the trainer is the head on its pod address, two worker nodes join
it on theirs, and the generation actors land on the worker nodes (never on the head) by the
generation resource, each asking for the GPUs of the worker nodes (read once they joined,
not from the head alone), and a run's generation goes through them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutrun_runtime.contract.pod import RAY_GENERATION_RESOURCE
from tests.support.ray_multinode import (
    HEAD_IP,
    WORKER_IPS,
    namespace_unavailable,
    run_in_namespace,
)


@pytest.mark.chaos  # three Ray nodes: about two minutes on a shared machine
@pytest.mark.timeout(900)
@pytest.mark.skipif(namespace_unavailable() is not None, reason=str(namespace_unavailable()))
def test_generation_actors_run_on_worker_nodes_of_the_trainers_head(tmp_path: Path) -> None:
    result = run_in_namespace(tmp_path, timeout_s=840)
    assert result["steps"] == 2 and result["history"] == [1, 2]
    placements = result["placements"]
    assert len(placements) == 2
    assert sorted(p["node_ip"] for p in placements) == sorted(WORKER_IPS)
    assert len({p["node_id"] for p in placements}) == 2
    assert all(p["resources"].get(RAY_GENERATION_RESOURCE) == 1.0 for p in placements)
    # Two worker nodes of one GPU each, the second joining after the driver connected:
    # a whole GPU per actor (before: 0 or 0.5, read from the cluster before it joined).
    assert [p["resources"].get("GPU") for p in placements] == [1.0, 1.0], placements
    assert all(p["url"].startswith(f"http://{p['node_ip']}:") for p in placements)
    assert HEAD_IP not in {p["node_ip"] for p in placements}

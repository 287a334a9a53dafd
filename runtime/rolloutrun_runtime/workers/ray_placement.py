"""Where the generation actors go and what they ask for: pure placement decisions of
:mod:`.ray_workers` (ports on a worker node, GPUs per actor), and the wait for the worker
nodes whose GPUs those are.

Why apart: :mod:`.ray_workers` holds the actors' life cycle (start, refits, losses,
replacements, standbys); these few decisions are tested on their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

import ray

from rolloutrun_runtime.contract.pod import RAY_GENERATION_RESOURCE, generation_slots
from rolloutrun_runtime.contract.run_config import Device, RunConfig
from rolloutrun_runtime.workers import WorkerError

#: How often the cluster's nodes are read while the worker nodes join.
NODE_POLL_S = 0.5


def candidate_ports(port: int, span: int) -> list[int]:
    """Where an actor tries to serve, in order: the ``span`` ports from ``port`` (a worker
    node's generation ports, the range its NetworkPolicy admits the Gyms to), then any
    free port (0: a port of the range still held by a dead actor's process)."""
    return [*range(port, port + span), 0] if port else [0]


def actor_gpus(device: Device, cluster_gpus: float, workers: int) -> float:
    """GPUs each generation actor asks Ray for.

    Ray hides GPUs from actors that ask for none, so an actor that should compute on CUDA
    must ask: a whole GPU each when there are enough, else an even share.
    """
    if device is Device.CPU or (device is Device.AUTO and cluster_gpus < 1):
        return 0.0
    if device is Device.CUDA and cluster_gpus < 1:
        raise WorkerError("policy.device is 'cuda' but the Ray cluster has no GPUs")
    return min(1.0, cluster_gpus / workers)


def node_ports(cfg: RunConfig) -> int:
    """Generation ports of a worker node: one per generation slot it offers."""
    return generation_slots(cfg.workers.generation_workers, cfg.workers.worker_nodes)


def generation_gpus(nodes: Iterable[Mapping[str, Any]], expected: int) -> float | None:
    """GPUs of the live nodes offering the generation resource (``ray.nodes()`` entries),
    or None while fewer than ``expected`` such nodes have joined."""
    offering = [
        node
        for node in nodes
        if node.get("Alive") and (node.get("Resources") or {}).get(RAY_GENERATION_RESOURCE)
    ]
    if len(offering) < expected:
        return None
    total = float(sum((node.get("Resources") or {}).get("GPU", 0.0) for node in offering))
    # standby worker nodes (alike) may have joined too: the GPUs of ``expected`` of them
    return total * expected / len(offering) if len(offering) > expected else total


async def joined_generation_gpus(expected: int, timeout_s: float) -> float:
    """:func:`generation_gpus` once ``expected`` worker nodes have joined. A coroutine that
    sleeps between reads, not a thread: a stop during the wait (the worker pods are stopped
    with the trainer and never join) cancels it at once, where a waiting thread held the
    trainer's exit until its timeout."""
    deadline = time.monotonic() + timeout_s
    while (gpus := generation_gpus(await asyncio.to_thread(ray.nodes), expected)) is None:
        if time.monotonic() > deadline:
            raise WorkerError(
                f"fewer than {expected} Ray worker node(s) offering {RAY_GENERATION_RESOURCE} "
                f"joined within {timeout_s:.0f} s (workers.workerNodes)"
            )
        await asyncio.sleep(NODE_POLL_S)
    return gpus

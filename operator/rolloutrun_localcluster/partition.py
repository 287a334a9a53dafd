"""The partition fault hook: cut a pod's (or a whole node's) links for N seconds.

Why: a trainer that is alive but unreachable is the case lease fencing exists for, and no
other lever plays it: deleting or freezing a pod stops its computing too. In namespace mode
(:mod:`.netns`) the pod's veth goes down and its forwarders to the machine's loopback pause,
so it can reach neither the API server, storage emulators on the machine, nor other pods,
and none can reach it; it keeps running. In loopback mode there is no link to cut: the
pod's processes are frozen instead (SIGSTOP), which is weaker (the pod stops computing, so
what it would do while cut off is never exercised) and said so in the log.

A node partition also stops the node's kubelet from reporting (the node turns
``Ready=Unknown``, its pods unready) as when a machine loses the control plane, and the
node comes back when the links heal.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kubelet import Kubelet
    from .podworker import PodWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Partition:
    """What was cut, how, and for how long."""

    pods: tuple[str, ...]
    node: str | None
    mode: str  # "links" (namespace mode) or "freeze" (loopback mode)
    seconds: float


def choose(
    kubelets: dict[str, Kubelet], namespace: str, pod: str | None, node: str | None
) -> tuple[list[PodWorker], Kubelet | None]:
    """The workers to cut off (and the kubelet, for a node); a clear error otherwise."""
    if (pod is None) == (node is None):
        raise ValueError("partition needs exactly one of pod= or node=")
    if node is not None:
        if node not in kubelets:
            raise ValueError(f"no node {node!r} (nodes: {', '.join(kubelets)})")
        return list(kubelets[node].workers.values()), kubelets[node]
    for kubelet in kubelets.values():
        for worker in kubelet.workers.values():
            if (worker.namespace, worker.name) == (namespace, pod):
                return [worker], None
    raise ValueError(f"pod {namespace}/{pod} is not running on any node")


async def start(
    kubelets: dict[str, Kubelet],
    *,
    namespace: str = "default",
    pod: str | None = None,
    node: str | None = None,
    seconds: float,
) -> Partition:
    """Cut now; heal after ``seconds`` (on the cluster's loop)."""
    if seconds <= 0:
        raise ValueError(f"partition seconds must be positive, not {seconds}")
    workers, kubelet = choose(kubelets, namespace, pod, node)
    network = next(iter(kubelets.values())).network
    uids = [worker.uid for worker in workers]
    links = network.mode == "namespaces"
    if kubelet is not None:
        kubelet.lose_node("partition")
    if links:
        await network.cut(uids)
    else:
        for worker in workers:
            worker.freeze(True)
        logger.warning("loopback pod network: partition plays as a freeze (SIGSTOP)")
    done = Partition(
        tuple(f"{w.namespace}/{w.name}" for w in workers),
        node,
        "links" if links else "freeze",
        seconds,
    )
    logger.info("partitioned %s for %gs (%s)", ", ".join(done.pods) or node, seconds, done.mode)

    async def heal() -> None:
        await asyncio.sleep(seconds)
        if links:
            await network.heal(uids)
        else:
            for worker in workers:
                worker.freeze(False)
        if kubelet is not None:
            kubelet.restore_node()
        logger.info("partition of %s healed", ", ".join(done.pods) or node)

    task = asyncio.create_task(heal(), name="localcluster-partition-heal")
    _pending.add(task)
    task.add_done_callback(_pending.discard)
    return done


_pending: set[asyncio.Task[None]] = set()

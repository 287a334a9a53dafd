"""Pod start latency in each pod network mode (``loopback`` against ``namespaces``), as JSON.

Each sample: one pod whose container is ``sh -c 'date +%s.%N'``; its latency is the time
from the client sending the create to the container's first instruction (the timestamp it
prints), so it covers scheduling, the kubelet's pod directory, the network namespace and
veth (namespace mode) and the process start. Pods start one after another on one cluster per
mode. Usage: ``python -m bench.pod_network [--pods 20]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from rolloutrun_localcluster import netns
from rolloutrun_localcluster.testing import api_client, eventually, local_cluster


def _started_at(core: Any, name: str) -> float | None:
    pod = core.read_namespaced_pod(name, "default")
    if pod.status.phase not in ("Succeeded", "Failed"):
        return None
    log = core.read_namespaced_pod_log(name, "default").strip()
    return float(log.splitlines()[-1]) if log else None


def bench_mode(mode: str, pods: int) -> dict[str, Any]:
    from kubernetes import client as k8s

    with tempfile.TemporaryDirectory() as directory:
        clusters = local_cluster(directory, network=mode)
        cluster = next(clusters)
        try:
            api = api_client(cluster)
            core: Any = k8s.CoreV1Api(api)
            samples = []
            for index in range(pods):
                name = f"p{index}"
                body = {
                    "metadata": {"name": name},
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {"name": "c", "image": "x", "command": ["sh", "-c", "date +%s.%N"]}
                        ],
                    },
                }
                sent = time.time()
                core.create_namespaced_pod("default", body)
                started = eventually(lambda n=name: _started_at(core, n), interval=0.02)
                samples.append(started - sent)
                core.delete_namespaced_pod(name, "default")
            api.close()
            description = cluster.network.description if cluster.network else mode
        finally:
            clusters.close()
    ordered = sorted(samples)
    return {
        "mode": description,
        "pods": pods,
        "p50_ms": round(ordered[len(ordered) // 2] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 1),
    }


def main(pods: int) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "pod_network", "loopback": bench_mode("loopback", pods)}
    why = netns.namespaces_unavailable()
    result["namespaces"] = {"skipped": why} if why else bench_mode("namespaces", pods)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=20)
    print(json.dumps(main(parser.parse_args().pods), indent=2))

"""Local cluster load benchmark: watch fan-out, list and pod start latency, printed as JSON.

- watch: W concurrent watches on one namespace's ConfigMaps (W = 1 as the baseline, then
  100); N ConfigMaps created one after another over HTTPS; each event's latency is the time
  from the client sending the create to a watcher receiving the ADDED event.
- list: GET of all ConfigMaps of a namespace holding 10 (baseline) and 1,000 objects.
- pod start: P pods (``sh -c 'date +%s.%N'`` with the volumes and read-only root of a member
  pod), one after another, on one cluster per combination of the cluster's two pod modes,
  ``LocalCluster(isolation=..., network=...)``: ``loopback+loopback`` (no namespaces) is the
  baseline, ``namespaces+namespaces`` (a mount and a network namespace per pod) the default
  where permitted, and each namespace kind alone. Two latencies per pod: from the create to
  the container's first instruction (the timestamp it prints) and to phase ``Succeeded``.
  A combination this machine cannot run is reported as skipped, with why.
- suite (``--suite``, off by default: about 15 minutes): one run of the default test suite
  (``python -m pytest -q -p no:cacheprovider``), its wall time and pass/fail counts.

The cluster runs in its own thread (as in tests); clients share one asyncio loop here, so
the numbers include client-side parsing on the same 2 cores. Usage:
``python -m bench.localcluster [--events 200] [--watchers 100] [--objects 1000] [--pods 20]
[--suite]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from rolloutrun_localcluster import mountns, netns
from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.kubelet import free_pod_network

REPO = Path(__file__).resolve().parents[1]
BASELINE = ("loopback", "loopback")
# (isolation, network): the baseline, each namespace kind alone, the default (both).
COMBINATIONS = (
    BASELINE,
    ("namespaces", "loopback"),
    ("loopback", "namespaces"),
    ("namespaces", "namespaces"),
)


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "p50_ms": round(pick(0.50) * 1000, 3),
        "p99_ms": round(pick(0.99) * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
        "samples": len(ordered),
    }


class Client:
    def __init__(self, cluster: LocalCluster) -> None:
        self.base = cluster.api_url
        self.headers = {"Authorization": f"Bearer {cluster.token}"}
        context = ssl.create_default_context(cafile=str(cluster.ca_path))
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=0),
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
        )

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, self.base + path, json=body) as response:
            data = await response.read()
            if response.status >= 300:
                raise RuntimeError(f"{method} {path}: {response.status} {data[:200]!r}")
            return json.loads(data)

    async def text(self, path: str) -> str:
        async with self.session.get(self.base + path) as response:
            data = await response.text()
            if response.status >= 300:
                raise RuntimeError(f"GET {path}: {response.status} {data[:200]!r}")
            return data

    async def close(self) -> None:
        await self.session.close()


async def _watcher(
    client: Client,
    path: str,
    since: str,
    expect: int,
    seen: dict[str, list[float]],
    ready: asyncio.Event,
    counter: list[int],
) -> None:
    url = f"{client.base}{path}?watch=true&resourceVersion={since}&allowWatchBookmarks=true"
    async with client.session.get(url) as response:
        counter[0] += 1
        if counter[0] == counter[1]:
            ready.set()
        got = 0
        async for line in response.content:
            event = json.loads(line)
            if event["type"] != "ADDED":
                continue
            seen.setdefault(event["object"]["metadata"]["name"], []).append(time.perf_counter())
            got += 1
            if got == expect:
                return


async def bench_watch(cluster: LocalCluster, watchers: int, events: int) -> dict[str, Any]:
    client = Client(cluster)
    namespace = f"watch-{watchers}"
    try:
        await client.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        path = f"/api/v1/namespaces/{namespace}/configmaps"
        since = (await client.request("GET", path))["metadata"]["resourceVersion"]
        seen: dict[str, list[float]] = {}
        ready = asyncio.Event()
        counter = [0, watchers]
        tasks = [
            asyncio.create_task(_watcher(client, path, since, events, seen, ready, counter))
            for _ in range(watchers)
        ]
        await asyncio.wait_for(ready.wait(), 60)
        await asyncio.sleep(0.2)  # every watch registered on the server
        sent: dict[str, float] = {}
        for index in range(events):
            name = f"cm-{index}"
            sent[name] = time.perf_counter()
            await client.request(
                "POST", path, {"metadata": {"name": name}, "data": {"i": str(index)}}
            )
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
        latencies = [t - sent[name] for name, times in seen.items() for t in times]
        return {
            "watchers": watchers,
            "events": events,
            "deliveries": len(latencies),
            **_percentiles(latencies),
        }
    finally:
        await client.close()


async def bench_list(cluster: LocalCluster, objects: int, rounds: int) -> dict[str, Any]:
    client = Client(cluster)
    namespace = f"list-{objects}"
    try:
        await client.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        path = f"/api/v1/namespaces/{namespace}/configmaps"
        for index in range(objects):
            body = {
                "metadata": {"name": f"cm-{index}", "labels": {"i": str(index % 10)}},
                "data": {"k": "v" * 64},
            }
            await client.request("POST", path, body)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            items = (await client.request("GET", path))["items"]
            samples.append(time.perf_counter() - start)
            assert len(items) == objects
        return {"objects": objects, **_percentiles(samples)}
    finally:
        await client.close()


def _member_like_pod(name: str) -> dict[str, Any]:
    mounts = [
        {"name": "config", "mountPath": "/etc/rolloutrun", "readOnly": True},
        {"name": "work", "mountPath": "/var/lib/rolloutrun"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    container = {
        "name": "main",
        "image": "none",
        "command": ["sh", "-c", "date +%s.%N"],
        "workingDir": "/var/lib/rolloutrun",
        "volumeMounts": mounts,
        "securityContext": {"readOnlyRootFilesystem": True},
    }
    volumes = [
        {"name": "config", "configMap": {"name": "bench"}},
        {"name": "work", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    spec = {"restartPolicy": "Never", "containers": [container], "volumes": volumes}
    return {"metadata": {"name": name}, "spec": spec}


def unavailable(isolation: str, network: str) -> str | None:
    """Why this machine cannot run the combination, or ``None`` when it can."""
    if isolation == mountns.NAMESPACES and not mountns.namespaces_permitted():
        return "mount namespaces: `unshare -m true` failed"
    return netns.namespaces_unavailable() if network == "namespaces" else None


async def _one_pod(client: Client, base: str, name: str) -> tuple[float, float]:
    """Create one pod and wait for it: seconds to its first instruction and to Succeeded."""
    sent, started = time.time(), time.perf_counter()
    await client.request("POST", f"{base}/pods", _member_like_pod(name))
    while True:
        pod = await client.request("GET", f"{base}/pods/{name}")
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            break
        await asyncio.sleep(0.002)
    done = time.perf_counter() - started
    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    printed = (await client.text(f"{base}/pods/{name}/log")).strip().splitlines()[-1]
    await client.request("DELETE", f"{base}/pods/{name}")
    return float(printed) - sent, done


async def bench_pod_start(isolation: str, network: str, pods: int) -> dict[str, Any]:
    """``pods`` short pods, one at a time, on a cluster in the given modes."""
    with (
        tempfile.TemporaryDirectory() as directory,
        LocalCluster(
            directory, isolation=isolation, network=network, pod_network=free_pod_network()
        ) as cluster,
    ):
        client = Client(cluster)
        base = "/api/v1/namespaces/default"
        try:
            body = {"metadata": {"name": "bench"}, "data": {"run.yaml": "{}"}}
            await client.request("POST", f"{base}/configmaps", body)
            samples = [await _one_pod(client, base, f"start-{index}") for index in range(pods)]
        finally:
            await client.close()
        return {
            "isolation": cluster.isolation,
            "network": cluster.network.description if cluster.network else network,
            "to_first_instruction": _percentiles([first for first, _ in samples]),
            "to_succeeded": _percentiles([done for _, done in samples]),
        }


async def bench_pod_starts(pods: int) -> dict[str, Any]:
    """Every combination, each against the baseline measured in the same run."""
    result: dict[str, Any] = {"baseline": "+".join(BASELINE)}
    for isolation, network in COMBINATIONS:
        key = f"{isolation}+{network}"
        why = unavailable(isolation, network)
        result[key] = {"skipped": why} if why else await bench_pod_start(isolation, network, pods)
    base = result[result["baseline"]]["to_succeeded"]["p50_ms"]
    for entry in result.values():
        if isinstance(entry, dict) and "to_succeeded" in entry:
            entry["p50_to_succeeded_vs_baseline"] = round(entry["to_succeeded"]["p50_ms"] / base, 2)
    return result


def bench_suite() -> dict[str, Any]:
    """One run of the default test suite: wall time and the counts pytest reports."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) ([a-z]+)", summary)}
    return {
        "command": " ".join(["python", *command[1:]]),
        "wall_s": round(wall, 1),
        "exit_code": done.returncode,
        "counts": counts,
        "summary": summary,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory, LocalCluster(directory) as cluster:
        result: dict[str, Any] = {"benchmark": "localcluster"}
        result["watch_baseline"] = await bench_watch(cluster, 1, args.events)
        result["watch"] = await bench_watch(cluster, args.watchers, args.events)
        result["list_baseline"] = await bench_list(cluster, 10, args.rounds)
        result["list"] = await bench_list(cluster, args.objects, args.rounds)
        result["configmaps_in_store"] = cluster.call(
            lambda: sum(1 for _ in cluster.store.objects("configmaps"))
        )
    result["pod_start"] = await bench_pod_starts(args.pods)
    if args.suite:
        result["suite"] = await asyncio.to_thread(bench_suite)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--watchers", type=int, default=100)
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument(
        "--suite", action="store_true", help="also time one run of the default test suite"
    )
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))

"""Operator recovery benchmark on the local cluster, printed as JSON.

- ``pod_lost_to_replacement_s``: a member pod of a running run (the real trainer and Gym
  pods) is deleted, as a spot reclaim does; the time until the next incarnation's first
  replacement pod exists, and until all its Gym pods exist. The old pods' termination is
  included (the operator starts the next incarnation once they are gone). Goal: p99 ≤ 2 s.
- ``lease_expiry_to_action_s``: the trainer is frozen (SIGSTOP, a hung process); the time
  from its last lease renewal until the operator deletes its pod. Goal: ≤ the lease
  duration + 2 s.
- ``sigterm_to_forced_snapshot_s``: the trainer pod is deleted (SIGTERM); the time until its
  forced snapshot is published (``snapshots.jsonl``). Goal: p99 ≤ 10 s.
- ``scale``: one operator process (``rolloutrun operator``) and 200 RolloutRuns whose pods
  cannot be scheduled (a node selector no node has), so only the operator works: the time
  from the first create until every run's first pass is done (status written, Gym pods
  created), the operator's peak and settled RSS, against one run as the baseline.

Usage: ``python -m bench.operator_recovery [--losses 12] [--freezes 3] [--runs 200]``.
Timings are wall-clock polls every 20 ms (so each sample carries up to 20 ms of polling).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rolloutrun_localcluster import LocalCluster
from rolloutrun_localcluster.embedded import EmbeddedRun
from rolloutrun_localcluster.kubelet import free_pod_network
from rolloutrun_localcluster.operator_access import operator_kubeconfig
from rolloutrun_localcluster.testing import api_client
from rolloutrun_operator.kube import permission_rules

POLL_S = 0.02
LEASE_DURATION_S = 4
WAIT_BOUND_S = 180.0

#: A run that never finishes during the benchmark, with a small model.
LONG_RUN: dict[str, Any] = {
    "apiVersion": "rolloutrun.dev/v1alpha1",
    "kind": "RolloutRun",
    "metadata": {"name": "bench"},
    "spec": {
        "storage": {"uri": "file:///replaced"},
        "gym": {"replicas": 2, "terminationGracePeriodSeconds": 5},
        "trainer": {"terminationGracePeriodSeconds": 20},
        "recovery": {
            "maxRestarts": 1000,
            "backoffSeconds": 0,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "elasticMembers": False,  # a lost Gym ends the incarnation: what is timed here
        },
        "run": {
            "seed": 5,
            "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 32},
            "task": {"name": "arithmetic", "datasetSize": 512, "maxOperand": 9, "maxNewTokens": 4},
            "grpo": {"groupSize": 4, "promptsPerStep": 4, "maxSteps": 100000, "maxStaleness": 1},
            "checkpointing": {
                "savePeriod": 5,
                "snapshotIntervalSeconds": 2,
                "targetLevel": "sibling",
                "preemptionGraceSeconds": 10,
            },
            "workers": {"backend": "inprocess"},
        },
    },
}


def wait(check: Any, what: str, bound: float = WAIT_BOUND_S) -> Any:
    deadline = time.monotonic() + bound
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(POLL_S)


def quantiles(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "n": len(ordered),
        "p50": round(statistics.median(ordered), 3),
        "p99": at(0.99),
        "max": round(ordered[-1], 3),
    }


# ------------------------------------------------------------------ recovery (real pods)
def incarnation(run: EmbeddedRun) -> int:
    return int(run.status().get("incarnation") or 0)


#: Every distinct ``status.lastFailure`` seen: (time, reason, pod).
FAILURES: set[tuple[str, str, str]] = set()


def note_failure(run: EmbeddedRun) -> None:
    last = run.status().get("lastFailure") or {}
    if last:
        FAILURES.add((last.get("time", ""), last.get("reason", ""), last.get("pod", "")))


def settled(run: EmbeddedRun) -> int:
    """Wait until the current incarnation's trainer trains: it holds its lease, its pod runs,
    and its train-step annotation moved twice (a trainer that crashed at resume still holds
    an unexpired lease for a while); return the incarnation."""
    seen: dict[int, set[str]] = {}

    def training() -> int | None:
        note_failure(run)
        n = incarnation(run)
        lease = run.lease()
        if not n or lease is None or not (lease.spec.holder_identity or "").endswith(f"/{n}"):
            return None
        step = (lease.metadata.annotations or {}).get("rolloutrun.dev/train-step", "")
        seen.setdefault(n, set()).add(step)
        pod = run.pods().get(f"bench-i{n}-trainer")
        running = pod is not None and pod.status.phase == "Running"
        return n if running and len(seen[n]) >= 3 else None

    return int(wait(training, "the trainer training"))


def forced_snapshot_time(run: EmbeddedRun, after: float) -> float | None:
    path = run.log_dir / "snapshots.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("reason") == "preemption" and float(record.get("t", 0)) >= after:
            outcome = str(record.get("rollout/checkpoint_outcome", ""))
            return float(record["t"]) if outcome.startswith("published") else None
    return None


def recovery(work: Path, losses: int, freezes: int) -> dict[str, Any]:
    replaced_first: list[float] = []
    replaced_all: list[float] = []
    sigterm: list[float] = []
    sigterm_missed = 0
    lease_action: list[float] = []
    with EmbeddedRun(LONG_RUN, work / "recovery") as run:
        for index in range(losses):
            n = settled(run)
            victim = ["trainer", "gym-0", "gym-1"][index % 3]
            pod = f"bench-i{n}-{victim}"
            wall0, t0 = time.time(), time.monotonic()
            run.delete_pod(pod)
            prefix = f"bench-i{n + 1}-"
            wait(lambda p=prefix: any(x.startswith(p) for x in run.pods()), "a replacement pod")
            replaced_first.append(time.monotonic() - t0)
            gyms = {f"{prefix}gym-0", f"{prefix}gym-1"}
            wait(lambda g=gyms: g <= set(run.pods()), "the replacement Gym pods")
            replaced_all.append(time.monotonic() - t0)
            if victim == "trainer":
                published = wait(
                    lambda w=wall0: forced_snapshot_time(run, w) or time.time() - w > 60,
                    "the forced snapshot",
                )
                if published is True:
                    sigterm_missed += 1
                else:
                    sigterm.append(float(published) - wall0)
        for _ in range(freezes):
            n = settled(run)
            pod = f"bench-i{n}-trainer"
            pids = run.pod_pids(pod)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            renewed = run.lease().spec.renew_time.timestamp()
            wait(
                lambda pod=pod: (
                    (p := run.pods().get(pod)) is None or p.metadata.deletion_timestamp is not None
                ),
                "the operator acting on the expired lease",
                bound=60,
            )
            lease_action.append(time.time() - renewed)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)  # it finds its lease lost and stops
                except ProcessLookupError:
                    pass
        note_failure(run)
        status = run.status()
    return {
        "pod_lost_to_replacement_s": {
            "first_pod": quantiles(replaced_first),
            "all_gym_pods": quantiles(replaced_all),
            "goal_p99_s": 2.0,
            "meets_goal": bool(replaced_first) and quantiles(replaced_first)["p99"] <= 2.0,
        },
        "lease_expiry_to_action_s": {
            **quantiles(lease_action),
            "lease_duration_s": LEASE_DURATION_S,
            "goal_s": LEASE_DURATION_S + 2,
            "meets_goal": bool(lease_action) and max(lease_action) <= LEASE_DURATION_S + 2,
        },
        "sigterm_to_forced_snapshot_s": {
            **quantiles(sigterm),
            "not_published": sigterm_missed,
            "goal_p99_s": 10.0,
            "meets_goal": bool(sigterm)
            and not sigterm_missed
            and quantiles(sigterm)["p99"] <= 10.0,
        },
        "losses_by_reason": dict(Counter(reason for _, reason, _ in sorted(FAILURES))),
        "incarnations": int(status.get("incarnation") or 0),
        "restarts": int(status.get("restarts") or 0),
        "preemptions": int(status.get("preemptions") or 0),
    }


# ------------------------------------------------------------------ scale (one operator)
def pending_run(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "rolloutrun.dev/v1alpha1",
        "kind": "RolloutRun",
        "metadata": {"name": name},
        "spec": {
            "storage": {"uri": f"file:///tmp/rolloutrun-bench/{name}"},
            "gym": {"replicas": 2, "nodeSelector": {"bench": "nowhere"}},
            "trainer": {"nodeSelector": {"bench": "nowhere"}},
            "run": {"workers": {"backend": "inprocess"}},
        },
    }


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_cpu_seconds(cluster: LocalCluster) -> float:
    """CPU time so far of the thread that runs the local API server (and its controllers)."""
    thread = cluster._thread
    assert thread is not None and thread.native_id is not None
    task = Path(f"/proc/self/task/{thread.native_id}/stat")
    fields = task.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drained(response: Any) -> None:
    """Read an undecoded response to its end (its connection goes back to the pool)."""
    response.read()


def with_parent() -> None:
    """In a child: SIGTERM when the benchmark's process dies, however it dies (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def exists(core: Any, namespace: str, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespaced_pod(name, namespace)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def reconcile_all(cluster: LocalCluster, namespace: str, count: int) -> dict[str, Any]:
    from kubernetes import client as k8s

    from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION

    api = api_client(cluster)
    core: Any = k8s.CoreV1Api(api)
    runs: Any = k8s.CustomObjectsApi(api)
    core.create_namespace({"metadata": {"name": namespace}})
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutrun_runtime.cli",
            "operator",
            "--kubeconfig",
            str(operator_kubeconfig(cluster, permission_rules())),  # the chart's rights
            "-n",
            namespace,
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(3.0)  # Kopf up and watching (an empty namespace: nothing to do yet)
        idle = rss_kib(operator.pid)
        t0 = time.monotonic()
        for index in range(count):
            runs.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, pending_run(f"r{index:03d}")
            )
        created = time.monotonic() - t0

        def all_reconciled() -> bool:
            items = runs.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
            done = sum(1 for r in items if (r.get("status") or {}).get("observedGeneration") == 1)
            pods = core.list_namespaced_pod(namespace).items
            return done == count and len(pods) == 2 * count

        wait(all_reconciled, f"{count} runs reconciled", bound=600)
        elapsed = time.monotonic() - t0
        time.sleep(10.0)  # settled: every daemon waiting
        settled_rss = rss_kib(operator.pid)
    finally:
        operator.send_signal(signal.SIGTERM)
        operator.wait(30)
        api.close()
    return {
        "runs": count,
        "create_all_s": round(created, 2),
        "reconcile_all_s": round(elapsed, 2),
        "per_run_ms": round(1000 * elapsed / count, 1),
        "rss_idle_mib": round(idle["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(settled_rss["VmHWM"] / 1024, 1),
        "rss_settled_mib": round(settled_rss["VmRSS"] / 1024, 1),
    }


def scale(work: Path, count: int) -> dict[str, Any]:
    with LocalCluster(work / "scale", pod_network=free_pod_network()) as cluster:
        from kubernetes import client as k8s

        from rolloutrun_operator.api.crdgen import build_crd

        api = api_client(cluster)
        crds: Any = k8s.ApiextensionsV1Api(api)
        crds.create_custom_resource_definition(build_crd())
        api.close()
        baseline = reconcile_all(cluster, "baseline", 1)
        loaded = reconcile_all(cluster, "load", count)
    return {"baseline": baseline, "load": loaded}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", type=int, default=12, help="member pods deleted")
    parser.add_argument("--freezes", type=int, default=3, help="trainers frozen")
    parser.add_argument("--runs", type=int, default=200, help="RolloutRuns for the scale test")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rolloutrun-bench-") as tmp:
        work = Path(tmp)
        report = {
            "machine": {"cpus": os.cpu_count()},
            "recovery": recovery(work, args.losses, args.freezes),
            "scale": scale(work, args.runs),
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU a generation worker pod's start costs, per process, side by side with a baseline tree
(issue 14: a worker deleted every 15 s).

Why: the worker bench (``bench.elastic --role worker``) showed each refill pod's start
burning ~7.5 CPU-seconds on the cores the trainer and the serving workers share; which
process spends it (the entry point, ``ray start``, the raylet, Ray's two agents, the
generation actor's process, idle workers the raylet prestarts) decides what to cut. This
runs, inside a private network namespace (:func:`tests.support.ray_multinode.run_in_namespace`),
one Ray head and, per round and tree, the tree's own worker entry point
(``python -m rolloutrun_runtime.workers.ray_node``) joining it as a worker pod does, while a
driver of that tree creates one :class:`~rolloutrun_runtime.workers.ray_workers.GenerationActor`
asking for the generation resource (the refill standby) and waits for its server. Every
process of the node (the entry point's session) is read from ``/proc`` every
:data:`SAMPLE_S` (``utime + stime``), labelled by its command line (:func:`label`), and
summed per label until the actor's server is up (``to_ready``) and over
:data:`STEADY_S` more (``steady``: what an idle standby keeps costing). Trees alternate
order each round. Only this machine's CPU time is compared; wall times are shown, noisy.

    python -m bench.worker_start_cpu --baseline /tmp/base28 --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
GCS_PORT = 6379
SAMPLE_S = 0.1
STEADY_S = 5.0
_HZ = os.sysconf("SC_CLK_TCK")
HERE = Path(__file__).resolve().parents[1]

#: (label, what in the command line says so), first match wins.
LABELS = (
    ("actor", "GenerationActor"),
    ("idle_worker", "ray::IDLE"),
    ("worker", "default_worker.py"),
    ("dashboard_agent", "dashboard/agent.py"),
    ("dashboard_agent", "ray_agent_stub.py"),  # its placeholder (workers/ray_boot.py)
    ("runtime_env_agent", "runtime_env/agent/main.py"),
    ("ray_start", "ray.scripts.scripts"),
    ("ray_start", "rolloutrun_runtime.workers.ray_boot"),  # Ray's CLI, run through ours
    ("ray_node", "rolloutrun_runtime.workers.ray_node"),
)

DRIVER = """
import json, sys, time
import ray, torch
from rolloutrun_runtime.contract.pod import RAY_GENERATION_RESOURCE
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.policy.family import build_policy_model, policy_tokenizer
from rolloutrun_runtime.workers.ray_workers import GenerationActor
cfg = RunConfig.model_validate(json.loads(sys.argv[1]))
ray.init(address=sys.argv[2], log_to_driver=False)
model = build_policy_model(cfg.policy, cfg.seed, policy_tokenizer(cfg.policy).vocab_size)
while any(n["Alive"] and n["Resources"].get(RAY_GENERATION_RESOURCE) for n in ray.nodes()):
    time.sleep(0.2)  # the last round's node, until the GCS has it dead
weights = ray.put({k: v.detach().clone() for k, v in model.state_dict().items()})
actor = GenerationActor.options(resources={RAY_GENERATION_RESOURCE: 1.0}).remote(
    cfg.model_dump(mode="json"), 0, 1)
ref = actor.start.remote(weights, 0, None, 0, "worker-start-bench-token", 1)
print("CREATED", flush=True)
placed = ray.get(ref, timeout=300)
print("READY " + json.dumps(placed), flush=True)
sys.stdin.readline()
"""

CONFIG = {
    "name": "worker-start",
    "seed": 5,
    "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 32, "device": "cpu"},
    "task": {"name": "arithmetic", "datasetSize": 64, "maxNewTokens": 4},
    "grpo": {"groupSize": 4, "promptsPerStep": 2, "maxSteps": 2},
    "workers": {"backend": "ray", "generationWorkers": 1, "workerNodes": 1},
}


def label(cmdline: str) -> str:
    """A process's kind by its command line (the raylet's names its agents' and workers'
    commands in its own arguments: it is told by its executable)."""
    if os.path.basename(cmdline.split(" ", 1)[0]) == "raylet":
        return "raylet"
    for name, marker in LABELS:
        if marker in cmdline:
            return name
    return "other"


def _stat(pid: int) -> tuple[int, int, float] | None:
    """(ppid, session, cpu seconds) of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[3]), (int(fields[11]) + int(fields[12])) / _HZ


def cmdline_of(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class NodeSampler:
    """CPU seconds per process of the session led by ``leader`` (and their descendants)."""

    def __init__(self, leader: int) -> None:
        self.leader = leader
        self.known: set[int] = {leader}
        self.cpu: dict[int, float] = {}
        self.labels: dict[int, str] = {}

    def sample(self) -> None:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := _stat(int(entry))) is not None:
                stats[int(entry)] = stat
        grew = True
        while grew:  # descendants by parent, and anything in the leader's session
            grew = False
            for pid, (ppid, session, _) in stats.items():
                if pid not in self.known and (ppid in self.known or session == self.leader):
                    self.known.add(pid)
                    grew = True
        for pid in self.known:
            if pid in stats:
                self.cpu[pid] = stats[pid][2]
                # relabelled while it lives: a child read before its exec shows its
                # parent's command; a worker that became the actor stays the actor
                name = label(cmdline_of(pid))
                if self.labels.get(pid) != "actor" and (name != "other" or pid not in self.labels):
                    self.labels[pid] = name

    def policies(self) -> dict[str, list[str]]:
        """The scheduling policies (``SCHED_*`` names) of each label's live processes."""
        names = {os.SCHED_OTHER: "other", os.SCHED_IDLE: "idle", os.SCHED_BATCH: "batch"}
        out: dict[str, set[str]] = {}
        for pid, name in self.labels.items():
            try:
                policy = os.sched_getscheduler(pid)
            except OSError:
                continue
            out.setdefault(name, set()).add(names.get(policy, str(policy)))
        return {k: sorted(v) for k, v in sorted(out.items())}

    def by_label(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, spent in self.cpu.items():
            name = self.labels.get(pid, "other")
            out[name] = out.get(name, 0.0) + spent
        return {k: round(v, 2) for k, v in sorted(out.items())}


def _env(tree: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": f"{tree}:{tree / 'operator'}:{tree / 'runtime'}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
    }


def one_start(tree: Path, work: Path) -> dict[str, Any]:
    """One worker node of ``tree`` joining the head, and its refill actor, measured."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(CONFIG), f"{HEAD_IP}:{GCS_PORT}"],
        env=_env(tree),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=(work / "driver.log").open("ab"),
        text=True,
    )
    assert driver.stdout is not None and driver.stdin is not None
    if driver.stdout.readline().strip() != "CREATED":
        raise RuntimeError(f"driver failed: {(work / 'driver.log').read_text()[-3000:]}")
    started = time.monotonic()
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutrun_runtime.workers.ray_node",
            f"--address={HEAD_IP}:{GCS_PORT}",
            f"--node-ip={NODE_IP}",
            "--slots=1",
        ],
        env=_env(tree),
        stdout=(work / "node.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    sampler = NodeSampler(node.pid)
    os.set_blocking(driver.stdout.fileno(), False)
    ready_line = ""
    try:
        while not ready_line.startswith("READY"):
            sampler.sample()
            ready_line = driver.stdout.readline() or ready_line
            if node.poll() is not None or driver.poll() is not None:
                logs = [(work / n).read_text()[-1500:] for n in ("node.log", "driver.log")]
                raise RuntimeError(f"node or driver ended: {logs}")
            if time.monotonic() - started > 300:
                raise RuntimeError("no actor after 300 s")
            time.sleep(SAMPLE_S)
        ready_s = time.monotonic() - started
        to_ready = sampler.by_label()
        steady_end = time.monotonic() + STEADY_S
        while time.monotonic() < steady_end:
            time.sleep(SAMPLE_S)
            sampler.sample()
        after = sampler.by_label()
        policies = sampler.policies()
    finally:
        node.send_signal(signal.SIGTERM)  # the raylet unregisters: the next round's actor
        try:  # is never placed on this node
            node.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()
        driver.stdin.close()
        driver.kill()
        driver.wait()
    steady = {k: round(after.get(k, 0.0) - to_ready.get(k, 0.0), 2) for k in after}
    return {
        "wall_to_ready_s": round(ready_s, 2),
        "to_ready": to_ready,
        "to_ready_total": round(sum(to_ready.values()), 2),
        "steady_per_s": {k: round(v / STEADY_S, 3) for k, v in steady.items() if v},
        "processes": dict(sorted(_count(sampler.labels).items())),
        "policies": policies,
        "placed": json.loads(ready_line.split(" ", 1)[1]),
    }


def _count(labels: dict[int, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in labels.values():
        out[name] = out.get(name, 0) + 1
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = sorted({k for row in rows for k in row[key]})
    return {k: round(sum(row[key].get(k, 0.0) for row in rows) / len(rows), 2) for k in names}


def main(work: Path) -> None:
    """In the namespace: a head, then the trees' worker starts, alternating."""
    spec = json.loads((work / "spec.json").read_text())
    trees = {name: Path(path) for name, path in spec["trees"].items()}
    head = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            f"--node-ip-address={HEAD_IP}",
            f"--port={GCS_PORT}",
            "--num-cpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ],
        env=_env(HERE),
        stdout=(work / "head.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    try:
        time.sleep(8.0)
        for index in range(spec["rounds"]):
            order = list(trees) if index % 2 == 0 else list(reversed(trees))
            for name in order:
                rows[name].append(one_start(trees[name], work))
                time.sleep(1.0)
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
    out = {
        name: {
            "mean_to_ready": _mean(per, "to_ready"),
            "mean_to_ready_total": round(sum(r["to_ready_total"] for r in per) / len(per), 2),
            "mean_steady_per_s": _mean(per, "steady_per_s"),
            "rounds": per,
        }
        for name, per in rows.items()
    }
    print(json.dumps(out), flush=True)


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_start_cpu")
    parser.add_argument("--baseline", type=Path, required=True, help="the baseline tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from tests.support.ray_multinode import run_in_namespace

    work = Path(tempfile.mkdtemp(prefix="worker-start-"))
    trees = {"this": str(HERE), "baseline": str(args.baseline.resolve())}
    (work / "spec.json").write_text(json.dumps({"trees": trees, "rounds": args.rounds}))
    load_before = os.getloadavg()
    result = run_in_namespace(work, timeout_s=1800, module="bench.worker_start_cpu")
    shutil.rmtree(work, ignore_errors=True)  # the logs: kept only when the run failed
    result["load"] = {"before": load_before, "after": os.getloadavg()}
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text)
    summary = {
        name: {k: result[name][k] for k in ("mean_to_ready", "mean_to_ready_total")}
        for name in trees
    }
    print(json.dumps({**summary, "load": result["load"]}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 2 and not sys.argv[1].startswith("-"):
        main(Path(sys.argv[1]))
    else:
        cli()

"""Trainer start-up on resume, phase by phase: process launch -> first redispatch.

Why its own module: ``bench/rollout_checkpoint.py``'s ``startup`` part says how long a
resumed trainer takes from launch to its first ``attempt_dispatched``; this says where that
time goes, side by side with another checkout in one invocation (trees alternating, each
round a fresh process per tree), so a cut is seen against its baseline on the same machine
at the same moment. ``rollout_checkpoint --parts startup_breakdown`` runs it.

Per resumed incarnation of short kill campaigns (``rolloutrun chaos``, snapshots after every
step, kills planned past a step so each is followed by a resume):

- ``launch_to_first_dispatch_s``: the campaign's launch time to the first
  ``attempt_dispatched`` of the resumed run in the trace;
- ``cpu_to_first_dispatch_s``: the trainer process's CPU time (user + system, read from
  ``/proc/<pid>/stat`` every few ms by a watcher thread) at that moment: what a shared
  machine inflates least;
- ``runqueue_to_first_dispatch_s``: the time the trainer was runnable but had no core (the
  kernel's schedstat) by then: wall minus CPU minus this is what it waited on (I/O, the
  Lease, its Gyms);
- ``keeper_cpu_to_first_dispatch_s``: the CPU time of the trainer's Lease keeper (its child
  process, on the pod path) by then: what the trainer's start-up shares the pod's cores with;
- ``phases``: the trainer's own start-up marks (``metrics.StartupClock``, in the
  ``restore_completed`` event), as wall seconds and CPU seconds per segment, each segment
  named by the mark that ends it; ``spawn`` is launch -> the process's start and
  ``first_dispatch`` the last mark -> the first redispatch. A checkout without marks
  reports only the totals.

``--lease`` (the default; ``--no-lease`` leaves it out) runs each campaign's trainers as a
pod runs them: under the run's ``coordination.k8s.io`` Lease on a local cluster's API server
(``ROLLOUTRUN_LEASE_NAME``, ``POD_NAMESPACE``, ``POD_NAME`` and a kubeconfig in their
environment), so what a pod pays before its first redispatch (the ``kubernetes`` client's
import, the Lease's reads and writes) is measured too. Every launch has the same pod name and
incarnation, as a restarted container has, so each takes the Lease over at once.

``--importtime`` adds one more campaign per tree under ``PYTHONPROFILEIMPORTTIME`` and
reports the resumed trainer's heaviest top-level imports (a top-level line is an import made
outside any other import, e.g. ``torch._dynamo`` pulled in by ``torch.optim`` on first use).

Usage: ``python -m bench.startup_breakdown --baseline DIR [--rounds 3] [--kills 2]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

#: How often the watcher reads the trainer's CPU time.
POLL_S = 0.005
#: Train steps of each campaign's run.
STEPS = 8


def kill_moments(kills: int) -> list[float]:
    """Kills spread over the run, each past a step (a snapshot follows every step), so that
    every kill is followed by a resumed trainer (a kill before the first snapshot is not)."""
    return [round(STEPS * (i + 1) / (kills + 1) + 0.3, 2) for i in range(kills)]


class _CpuWatcher:
    """Samples ``(unix time, cpu seconds, run-queue seconds)`` of each child ``rolloutrun ...
    trainer`` process: the run-queue time (``/proc/<pid>/schedstat``, time runnable but
    waiting for a core) tells a trainer slowed by other processes from one that waits on
    I/O or on its Lease. And the CPU seconds of each trainer's Lease keeper (its child
    ``rolloutrun_runtime.lease_keeper`` process, where it has one): the pod's other core
    is shared with it."""

    def __init__(self) -> None:
        self.samples: dict[int, list[tuple[float, float, float]]] = {}
        self.keepers: dict[int, int] = {}  # trainer pid -> its keeper's pid
        self.keeper_samples: dict[int, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> _CpuWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _trainers(self) -> list[int]:
        me = str(os.getpid())
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[1] != me:
                    continue
                if b"trainer" in Path(entry.path, "cmdline").read_bytes():
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
        return found

    def _run(self) -> None:
        alive: list[int] = []
        while not self._stop.is_set():
            if not alive:
                alive = self._trainers()
            for pid in list(alive):
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    alive.remove(pid)
                    continue
                if fields[0] == "Z":
                    alive.remove(pid)
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / self._tick
                self.samples.setdefault(pid, []).append((time.time(), cpu, _queued(pid)))
                self._sample_keeper(pid)
            time.sleep(POLL_S)

    def _sample_keeper(self, trainer: int) -> None:
        keeper = self.keepers.get(trainer) or _keeper_of(trainer)
        if keeper is None:
            return
        self.keepers[trainer] = keeper
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{keeper}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            self.keeper_samples.setdefault(trainer, []).append((time.time(), cpu))

    def keeper_cpu_at(self, t: float) -> float | None:
        """The CPU time, at ``t``, of the Lease keeper of the trainer running then."""
        for trainer, samples in self.samples.items():
            if samples[0][0] <= t <= samples[-1][0] + 1.0:
                before = [cpu for when, cpu in self.keeper_samples.get(trainer, []) if when <= t]
                return before[-1] if before else None
        return None

    def cpu_at(self, t: float, column: int = 1) -> float | None:
        """The CPU time (``column`` 2: the run-queue time), at ``t``, of the trainer that
        was running then."""
        for samples in self.samples.values():
            if samples[0][0] <= t <= samples[-1][0] + 1.0:
                before = [sample[column] for sample in samples if sample[0] <= t]
                return before[-1] if before else None
        return None


def _keeper_of(trainer: int) -> int | None:
    """The trainer's Lease keeper process (a child of its main thread), if started."""
    try:
        children = Path(f"/proc/{trainer}/task/{trainer}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        with contextlib.suppress(OSError):
            if b"lease_keeper" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


def _queued(pid: int) -> float:
    """Seconds ``pid`` has been runnable without a core (0 where schedstat is missing)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def segments(marks: dict[str, list[float]], launch: float, first: float) -> dict[str, Any]:
    """Wall and CPU seconds per segment between consecutive marks (named by the later one)."""
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    previous_t, previous_cpu = launch, 0.0
    for name, (t, spent) in sorted(marks.items(), key=lambda item: item[1][0]):
        wall["spawn" if name == "process_started" else name] = round(t - previous_t, 4)
        if name != "process_started":
            cpu[name] = round(spent - previous_cpu, 4)
        previous_t, previous_cpu = t, spent
    wall["first_dispatch"] = round(first - previous_t, 4)
    return {"wall_s": wall, "cpu_s": cpu}


def _resumed_samples(log_dir: Path, launched: list[float], watcher: _CpuWatcher) -> list[dict]:
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
    from rolloutrun_runtime.contract.layout import TRACE_FILE

    by_run: dict[str, list[dict[str, Any]]] = {}
    for event in sorted(read_events(log_dir / TRACE_FILE), key=lambda e: e["t"]):
        by_run.setdefault(event["run_id"], []).append(event)
    out = []
    for events in by_run.values():
        started = next((e for e in events if e["event"] == "run_started"), None)
        first = next((e for e in events if e["event"] == "attempt_dispatched"), None)
        if started is None or not started.get("resumed_from") or first is None:
            continue
        launch = max((t for t in launched if t <= started["t"]), default=None)
        if launch is None:
            continue
        done = next((e for e in events if e["event"] == "restore_completed"), {})
        cpu = watcher.cpu_at(first["t"])
        queued = watcher.cpu_at(first["t"], column=2)
        sample: dict[str, Any] = {
            "launch_to_first_dispatch_s": round(first["t"] - launch, 4),
            "cpu_to_first_dispatch_s": None if cpu is None else round(cpu, 3),
            "runqueue_to_first_dispatch_s": None if queued is None else round(queued, 3),
            "keeper_cpu_to_first_dispatch_s": watcher.keeper_cpu_at(first["t"]),
        }
        if done.get("startup"):
            sample["phases"] = segments(done["startup"], launch, first["t"])
        out.append(sample)
    return out


@contextlib.contextmanager
def _pod_lease(root: Path) -> Iterator[None]:
    """The trainers' environment as in a pod, with the run's Lease on a local cluster's API
    server (created unheld, as the operator creates it); restored afterwards."""
    from kubernetes import client

    from rolloutrun_localcluster.testing import api_client, local_cluster
    from rolloutrun_runtime.contract.pod import ENV_LEASE_NAME, ENV_POD_NAME, ENV_POD_NAMESPACE

    for cluster in local_cluster(root / "cluster"):
        api = api_client(cluster)
        body = {"metadata": {"name": "bench-trainer"}, "spec": {"leaseDurationSeconds": 15}}
        leases: Any = client.CoordinationV1Api(api)
        leases.create_namespaced_lease("default", body)
        api.close()
        env = {
            ENV_LEASE_NAME: "bench-trainer",
            ENV_POD_NAMESPACE: "default",
            ENV_POD_NAME: "bench-trainer-pod",
            "KUBECONFIG": str(cluster.kubeconfig_path),
        }
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def one_campaign(root: Path, kills: int, seed: int, lease: bool = True) -> list[dict[str, Any]]:
    """A short kill campaign on this process's runtime; one sample per resumed trainer."""
    from bench.rollout_checkpoint import _config
    from rolloutrun_runtime.chaos import run_chaos

    config = _config(root / "startup.yaml", STEPS, snapshotIntervalSeconds=1, snapshotEverySteps=1)
    with _pod_lease(root) if lease else contextlib.nullcontext(), _CpuWatcher() as watcher:
        result = run_chaos(
            config,
            root / "startup",
            kills=kills,
            seed=seed,
            compare=False,
            kill_at=kill_moments(kills),
        )
    launched = result.to_json()["incarnations_launched_at"]
    samples = _resumed_samples(root / "startup", launched, watcher)
    if os.environ.get("PYTHONPROFILEIMPORTTIME"):
        logs = sorted((root / "startup").glob("chaos-trainer-*.log"))[1:]  # the resumed ones
        for sample, log in zip(samples, logs, strict=False):
            sample["top_level_imports_s"] = top_level_imports(log.read_text())
    return samples


def top_level_imports(text: str, count: int = 12) -> dict[str, float]:
    """The heaviest imports made outside any other import, cumulative seconds."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|", 2)
        if cumulative.strip().isdigit() and not name[1:].startswith(" "):
            rows.append((int(cumulative) / 1e6, name.strip()))
    rows.sort(reverse=True)
    return {name: round(seconds, 3) for seconds, name in rows[:count]}


def _run_tree(
    tree: Path, kills: int, seed: int, importtime: bool = False, lease: bool = True
) -> list[dict]:
    here = Path(__file__).resolve().parent.parent
    # The tree's runtime; this checkout's operator (the local cluster the Lease lives on).
    path = [str(here), str(tree / "runtime"), str(here / "operator")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    if importtime:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    command = [sys.executable, "-m", "bench.startup_breakdown", "--one"]
    done = subprocess.run(
        [*command, "--kills", str(kills), "--seed", str(seed), *([] if lease else ["--no-lease"])],
        env=env,
        cwd=here,
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def compile_tree(tree: Path) -> None:
    """Byte-compile the tree's runtime once, as ``pip install`` does in the runtime image.

    Why: with ``PYTHONDONTWRITEBYTECODE`` set (the image sets it, so may a developer's shell)
    an uncompiled checkout recompiles each runtime module at every launch (~0.15 s of CPU
    here), a cost a pod never pays; both trees are compiled alike."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(tree / "runtime")],
        check=True,
        capture_output=True,
        timeout=600,
    )


def _stats(given: list[float | None]) -> dict[str, float | None]:
    values = sorted(v for v in given if v is not None)
    if not values:
        return {"p50": None, "worst": None, "n": 0}
    return {
        "p50": round(statistics.median(values), 3),
        "worst": round(values[-1], 3),
        "n": len(values),
    }


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """p50 and worst of the totals and of each phase's wall and CPU seconds."""
    out: dict[str, Any] = {
        "samples": len(samples),
        "launch_to_first_dispatch_s": _stats([s["launch_to_first_dispatch_s"] for s in samples]),
        "cpu_to_first_dispatch_s": _stats([s["cpu_to_first_dispatch_s"] for s in samples]),
        "runqueue_to_first_dispatch_s": _stats(
            [s.get("runqueue_to_first_dispatch_s") for s in samples]
        ),
        "keeper_cpu_to_first_dispatch_s": _stats(
            [s.get("keeper_cpu_to_first_dispatch_s") for s in samples]
        ),
    }
    with_phases = [s["phases"] for s in samples if "phases" in s]
    for kind in ("wall_s", "cpu_s"):
        names = list(dict.fromkeys(n for p in with_phases for n in p[kind]))
        if names:
            out[f"phases_{kind}"] = {
                n: _stats([p[kind].get(n) for p in with_phases if n in p[kind]]) for n in names
            }
    return out


def side_by_side(
    baseline: str,
    rounds: int,
    kills: int,
    seed: int,
    importtime: bool = False,
    lease: bool = True,
) -> dict[str, Any]:
    """Both trees, ``rounds`` times alternating, one fresh process each; then summaries."""
    here = Path(__file__).resolve().parent.parent
    trees = {"baseline": Path(baseline).resolve(), "this_tree": here}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for tree in trees.values():
        compile_tree(tree)
    for _ in range(rounds):
        for name, tree in trees.items():
            raw[name].extend(_run_tree(tree, kills, seed, lease=lease))
    report: dict[str, Any] = {name: summarize(raw[name]) for name in trees}
    report["raw"] = raw
    if importtime:
        report["imports"] = {
            name: _run_tree(tree, 1, seed, importtime=True, lease=lease)
            for name, tree in trees.items()
        }
    mine = report["this_tree"]["launch_to_first_dispatch_s"]["worst"]
    report["goal"] = "<= 2 s from process launch to the first redispatch (worst sample)"
    report["met"] = mine is not None and mine <= 2.0
    report["pod_lease"] = lease
    report["machine"] = {"cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a checkout whose start-up runs side by side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=2, help="kills (resumes) per campaign")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--importtime", action="store_true")
    parser.add_argument(
        "--lease",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trainers under the run's Lease on a local API server, as in a pod",
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory(prefix="rr-bench-startup-") as tmp:
            print(json.dumps(one_campaign(Path(tmp), args.kills, args.seed, args.lease)))
        return 0
    if not args.baseline:
        parser.error("--baseline DIR is required (e.g. `git archive` of the base commit)")
    report = side_by_side(
        args.baseline, args.rounds, args.kills, args.seed, args.importtime, args.lease
    )
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

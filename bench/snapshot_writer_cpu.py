"""CPU a snapshot costs after its cut (the writer thread), this tree against another checkout.

Why: the throughput goal (a snapshot after every step vs none, >= 0.995) cannot be read off
the wall clock on a shared 2-core machine (ratios moved 0.64-1.21 between repetitions), and
the CPU ratio mixes the writer's share with the cut's and the environment phase's. This
measures only the writer's share, per snapshot: the thread CPU (user + system) of
serializing the capture (``write_controller_sidecars``) and of publishing it
(``ManifestStore.publish``: segments, files, manifest, LATEST, retention, segment
collection), over whole runs of the tiny config with a snapshot after every step, the
trees' runs interleaved (``--baseline DIR``), each a fresh process.

``python -m bench.snapshot_writer_cpu [--baseline DIR] [--repetitions N] [--out FILE]``.

``--groups 1000 10000`` measures instead a controller filled with that many buffered groups
(``bench.rollout_checkpoint``'s), forced snapshots each after ``CHURN_GROUPS`` groups were
trained and as many finalized: per snapshot the writer's CPU and the bytes written for the
data plane's ``metadata.json`` and the ledger sidecar (with their chain chunks, where the
tree writes them), per tree in a fresh process, trees alternating.

``--control-cycles N`` measures instead the environment phase's fixed cost: a real Gym
replica and the trainer's client, N phases (prepare, commit, resume) with no episode out,
per phase the client's thread CPU and the replica's process CPU, per tree in a fresh
process, trees alternating (this is the cost the control round trips add to every snapshot).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.tree_run import run_in_tree

STEPS = 24
#: Groups trained and as many finalized before each snapshot of ``--groups``.
CHURN_GROUPS = 40
#: Forced snapshots measured per size in ``--groups`` (after a first, unmeasured one).
GROUPS_SNAPSHOTS = 8


def _instrument() -> dict[str, list[float]]:
    """Thread CPU of each call of the writer's two steps (in this process's runtime)."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing import manifest, snapshots

    spent: dict[str, list[float]] = {"serialize": [], "publish": []}
    serialize = snapshots.RolloutSnapshotter.write_controller_sidecars
    publish = manifest.ManifestStore.publish

    def timed_serialize(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return serialize(*args, **kwargs)
        finally:
            spent["serialize"].append(time.thread_time() - started)

    def timed_publish(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return publish(*args, **kwargs)
        finally:
            spent["publish"].append(time.thread_time() - started)

    snapshots.RolloutSnapshotter.write_controller_sidecars = staticmethod(timed_serialize)
    manifest.ManifestStore.publish = timed_publish  # type: ignore[method-assign]
    return spent


def _instrument_child() -> list[float]:
    """The CPU (user + system, s) of each writer process the run started, read as it is
    closed (trees whose snapshots are written in the trainer's thread start none)."""
    cpu: list[float] = []
    try:
        from rolloutrun_runtime.storage import writer_process
    except ImportError:
        return cpu
    close = writer_process.WriterProcess.close

    def counted(self: Any) -> None:
        pid = self.pid
        if pid is not None:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            cpu.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        close(self)

    writer_process.WriterProcess.close = counted  # type: ignore[method-assign]
    return cpu


def _instrument_requests() -> list[float]:
    """The thread CPU of each call to the writer process (building and sending a request,
    waiting for and reading its answer: inside ``publish``), where the tree has one."""
    spent: list[float] = []
    try:
        from rolloutrun_runtime.storage import writer_process
    except ImportError:
        return spent
    call = writer_process.WriterProcess._call

    def timed(self: Any, *args: Any) -> Any:
        started = time.thread_time()
        try:
            return call(self, *args)
        finally:
            spent.append(time.thread_time() - started)

    writer_process.WriterProcess._call = timed  # type: ignore[method-assign]
    return spent


def one(config: Path, log_dir: Path) -> dict[str, Any]:
    """One run of ``config`` in this process; the writer's CPU per snapshot (ms): the
    thread's, and the writer process's where the tree has one (its whole life's CPU over
    the snapshots, a mean: ``child_ms``)."""
    from bench.rollout_throughput import run_one

    spent = _instrument()
    child = _instrument_child()
    requests = _instrument_requests()
    run_one(config, log_dir)
    per = [s + p for s, p in zip(spent["serialize"], spent["publish"], strict=False)]
    snapshots = len(spent["publish"])
    return {
        "snapshots": snapshots,
        "serialize_ms": round(statistics.median(spent["serialize"]) * 1000, 3),
        "publish_ms": round(statistics.median(spent["publish"]) * 1000, 3),
        "writer_ms": round(statistics.median(per) * 1000, 3),
        "child_ms": round(sum(child) * 1000 / max(snapshots, 1), 3),
        # the writer process's calls (part of publish_ms): a mean per snapshot, and how many
        "requests_ms": round(sum(requests) * 1000 / max(snapshots, 1), 3),
        "requests_per_snapshot": round(len(requests) / max(snapshots, 1), 2),
    }


def _written_bytes() -> list[dict[str, int]]:
    """Per publication: bytes of ``metadata.json`` and the ledger sidecar, and of the chain
    chunks (``.json`` beside the data segments) written with it."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing import manifest
    from rolloutrun_runtime.contract.layout import DATA_PLANE_PREFIX, LEDGER_FILE

    sizes: list[dict[str, int]] = []
    publish = manifest.ManifestStore.publish

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        files, chunks = kwargs.get("files", {}), kwargs.get("segment_files") or {}
        sizes.append(
            {
                "metadata_json": len(files.get(DATA_PLANE_PREFIX + "metadata.json", b"")),
                "ledger": len(files.get(LEDGER_FILE, b"")),
                "chain_chunks": sum(len(v) for k, v in chunks.items() if k.endswith(".json")),
            }
        )
        return publish(self, *args, **kwargs)

    manifest.ManifestStore.publish = counted  # type: ignore[method-assign]
    return sizes


async def groups_one(groups: int) -> dict[str, Any]:
    """Forced snapshots of a filled controller, ``CHURN_GROUPS`` changed before each: the
    writer's CPU (ms) and the metadata + ledger bytes written, median per snapshot."""
    import gc

    from bench.rollout_checkpoint import _churn, _filled_controller

    spent = _instrument()  # wraps ``publish`` first: the byte count runs inside it
    sizes = _written_bytes()
    with tempfile.TemporaryDirectory(prefix="writer-groups-") as tmp:
        controller = await _filled_controller(groups, Path(tmp))
        snapshotter = controller.rollout_snapshots
        try:
            await snapshotter.attempt(force=True, reason="bench")  # the base, not measured
            for repeat in range(1, GROUPS_SNAPSHOTS + 1):
                await _churn(controller, groups + repeat * CHURN_GROUPS, CHURN_GROUPS, repeat)
                await snapshotter.attempt(force=True, reason="bench")
        finally:
            gc.unfreeze()
    serialize, publish = spent["serialize"][1:], spent["publish"][1:]
    written = sizes[1:]
    if len(written) != GROUPS_SNAPSHOTS:
        raise RuntimeError(f"{len(written)} of {GROUPS_SNAPSHOTS} snapshots published")

    def median_ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 2)

    return {
        "groups": groups,
        "snapshots": len(written),
        "serialize_ms": median_ms(serialize),
        "publish_ms": median_ms(publish),
        "writer_ms": median_ms([a + b for a, b in zip(serialize, publish, strict=True)]),
        **{
            f"{key}_bytes": int(statistics.median(w[key] for w in written))
            for key in ("metadata_json", "ledger", "chain_chunks")
        },
    }


def compare_groups(baseline: str | None, sizes: list[int], repetitions: int) -> dict[str, Any]:
    """Per size, ``repetitions`` rounds of a fresh process per tree, the order alternating."""
    here = Path(__file__).resolve().parent.parent
    trees = {"this_tree": here}
    if baseline:
        trees = {"baseline": Path(baseline).resolve(), **trees}
    out: dict[str, Any] = {
        "churn_groups": CHURN_GROUPS,
        "cpus": os.cpu_count(),
        "load_1m": [round(os.getloadavg()[0], 2)],
        "by_groups": [],
    }
    for groups in sizes:
        runs: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
        for rep in range(repetitions):
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            for tree in order:
                runs[tree].append(_tree_json(trees[tree], ["--groups-one", str(groups)]))
        row: dict[str, Any] = {"groups": groups}
        for tree, got in runs.items():
            row[tree] = {
                "per_run": got,
                **{
                    key: statistics.median(r[key] for r in got)
                    for key in got[0]
                    if key.endswith(("_ms", "_bytes"))
                },
            }
        out["by_groups"].append(row)
        out["load_1m"].append(round(os.getloadavg()[0], 2))
    out["trees"] = {name: str(path) for name, path in trees.items()}
    return out


async def control_one(cycles: int) -> dict[str, Any]:
    """A real Gym replica (the tiny config) and the trainer's client: ``cycles`` snapshot
    environment phases with no episode out (prepare, commit, resume, as the snapshotter
    calls them), after 20 unmeasured ones; per phase the client's thread CPU (this event
    loop) and the replica's process CPU."""
    import secrets

    import yaml

    from bench.rollout_checkpoint import TINY
    from bench.rollout_throughput import _process_cpu_s
    from rolloutrun_runtime.environments.checkpointing.nemo_gym import GymEnvironmentCheckpoint
    from rolloutrun_runtime.launcher import start_gym, stop_process

    root = Path(tempfile.mkdtemp(prefix="rr-bench-control-"))
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    token = secrets.token_hex(16)
    gym = start_gym(config, root, 0, token)
    client = GymEnvironmentCheckpoint({"gym-0": gym.url}, token)

    async def phase(n: int) -> None:
        checkpoint_id, deadline = f"bench-{n}", time.time() + 30.0
        failed = await client.prepare(checkpoint_id, deadline)
        await client.commit(checkpoint_id, deadline, [], failed)
        await client.resume(checkpoint_id)

    try:
        for n in range(20):
            await phase(n)
        cpu, gym_cpu = time.thread_time(), _process_cpu_s(gym.process.pid)
        for n in range(20, 20 + cycles):
            await phase(n)
        cpu, gym_cpu = time.thread_time() - cpu, _process_cpu_s(gym.process.pid) - gym_cpu
    finally:
        await client.close()
        stop_process(gym.process)
        gym.log.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "cycles": cycles,
        "trainer_loop_ms": round(cpu * 1000 / cycles, 3),
        "gym_ms": round(gym_cpu * 1000 / cycles, 3),
        "total_ms": round((cpu + gym_cpu) * 1000 / cycles, 3),
    }


def compare_control(baseline: str | None, cycles: int, repetitions: int) -> dict[str, Any]:
    """``repetitions`` rounds of a fresh process per tree, the order alternating."""
    trees = {"this_tree": Path(__file__).resolve().parent.parent}
    if baseline:
        trees = {"baseline": Path(baseline).resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    load = [round(os.getloadavg()[0], 2)]
    for rep in range(repetitions):
        for tree in list(trees) if rep % 2 == 0 else list(reversed(trees)):
            runs[tree].append(_tree_json(trees[tree], ["--control-one", str(cycles)]))
            load.append(round(os.getloadavg()[0], 2))
    out: dict[str, Any] = {"cpus": os.cpu_count(), "load_1m": load}
    for tree, got in runs.items():
        out[tree] = {
            "tree": str(trees[tree]),
            "per_run": got,
            **{
                key: statistics.median(r[key] for r in got) for key in got[0] if key.endswith("_ms")
            },
        }
    return out


def _tree_json(tree: Path, args: list[str]) -> dict[str, Any]:
    return dict(run_in_tree(tree, "bench.snapshot_writer_cpu", args, 1800))


def _run_tree(tree: Path, config: Path, log_dir: Path) -> dict[str, Any]:
    argv = ["--one", str(config), str(log_dir)]
    return dict(run_in_tree(tree, "bench.snapshot_writer_cpu", argv, 900))


def compare(baseline: str | None, repetitions: int, root: Path) -> dict[str, Any]:
    """``repetitions`` rounds, the trees' order alternating; per tree the median over runs."""
    from bench.rollout_checkpoint import TINY
    from bench.rollout_throughput import _write_config, spread

    here = Path(__file__).resolve().parent.parent
    trees = {"this_tree": here}
    if baseline:
        trees = {"baseline": Path(baseline).resolve(), **trees}
    config = _write_config(TINY, root / "writer-on.yaml", "on", STEPS)
    runs: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    load = [round(os.getloadavg()[0], 2)]
    for rep in range(repetitions):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for tree in order:
            runs[tree].append(_run_tree(trees[tree], config, root / f"writer-{tree}-{rep}"))
        load.append(round(os.getloadavg()[0], 2))
    out: dict[str, Any] = {"steps": STEPS, "load_1m_per_round": load, "cpus": os.cpu_count()}
    for tree, got in runs.items():
        out[tree] = {
            "tree": str(trees[tree]),
            "per_run": got,
            **{
                key: spread([r[key] for r in got])
                for key in (
                    "writer_ms",
                    "serialize_ms",
                    "publish_ms",
                    "child_ms",
                    "requests_ms",
                    "requests_per_snapshot",
                )
            },
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "LOGDIR"))
    parser.add_argument(
        "--baseline", help="another checkout, its runs interleaved with this tree's"
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--groups", type=int, nargs="+", help="filled controllers of these sizes instead"
    )
    parser.add_argument("--groups-one", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--control-cycles",
        type=int,
        help="measure instead the CPU of a snapshot's environment phase with no episode out "
        "(trainer's loop + Gym replica, per phase), over this many phases per run",
    )
    parser.add_argument("--control-one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(Path(args.one[0]), Path(args.one[1]))))
        return 0
    if args.groups_one:
        import asyncio

        print(json.dumps(asyncio.run(groups_one(args.groups_one))))
        return 0
    if args.control_one:
        import asyncio

        print(json.dumps(asyncio.run(control_one(args.control_one))))
        return 0
    if args.control_cycles:
        result = compare_control(args.baseline, args.control_cycles, args.repetitions)
    elif args.groups:
        result = compare_groups(args.baseline, args.groups, args.repetitions)
    else:
        with tempfile.TemporaryDirectory(prefix="writer-cpu-") as root:
            result = compare(args.baseline, args.repetitions, Path(root))
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the checkpoint storage backends side by side: file:// vs gs:// (emulator).

Prints one JSON object: for each backend, small-object write / read / create-only latency
(p50, p95 in ms), the latency of publishing and listing a committed entry, and large-file
upload / download throughput (MiB/s); and ``snapshot_publish``: publishing a snapshot of N
files on gs:// with one upload at a time (the baseline: how every release before parallel
uploads published) against ``parallel_uploads`` at once, with and without a simulated
network round trip (a delaying proxy on 127.0.0.1). The gs:// numbers are against a local
fake-gcs-server, so they measure the client, HTTP and resumable-upload overhead, not GCS
itself; the file:// numbers include every fsync the crash-safety design pays for.

    .venv/bin/python -m bench.storage [--iterations 50] [--large-mib 64]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutrun_runtime.storage import (
    CheckpointStorage,
    list_committed,
    open_storage,
    publish_entry,
)
from rolloutrun_runtime.storage.gcs import PARALLEL_UPLOADS, GcsStorage
from tests.support.gcs_emulator import FakeGcs, FaultProxy

BUCKET = "rolloutrun-bench"


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3), "p95_ms": round(p95 * 1e3, 3)}


def _timed(fn: Callable[[int], object], iterations: int) -> list[float]:
    samples = []
    for i in range(iterations):
        start = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
    return samples


def bench_backend(
    storage: CheckpointStorage, workdir: Path, iterations: int, large_mib: int
) -> dict[str, Any]:
    small = os.urandom(4096)
    result: dict[str, Any] = {"base_uri": storage.base_uri}
    result["write_4KiB"] = _ms(
        _timed(lambda i: storage.write_bytes(f"small/{i}", small), iterations)
    )
    result["read_4KiB"] = _ms(_timed(lambda i: storage.read_bytes(f"small/{i}"), iterations))
    result["create_only_4KiB"] = _ms(
        _timed(lambda i: storage.write_bytes_if_absent(f"markers/{i}", small), iterations)
    )
    shard = os.urandom(256 * 1024)
    files = {f"shard_{j}.bin": shard for j in range(4)}
    publishes = max(3, iterations // 5)
    result["publish_4x256KiB"] = _ms(
        _timed(lambda i: publish_entry(storage, f"snaps/step_{i}", files), publishes)
    )
    result["list_committed"] = _ms(_timed(lambda _: list_committed(storage, "snaps"), 10))
    result["list_committed_entries"] = publishes

    big = workdir / "large.bin"
    with open(big, "wb") as f:
        for _ in range(large_mib):
            f.write(os.urandom(1024 * 1024))
    start = time.perf_counter()
    storage.upload_file("large/weights.bin", big)
    up = time.perf_counter() - start
    back = workdir / "large.back"
    start = time.perf_counter()
    storage.download_file("large/weights.bin", back)
    down = time.perf_counter() - start
    if back.read_bytes() != big.read_bytes():
        raise RuntimeError(f"{storage.base_uri}: downloaded file differs from the upload")
    result[f"upload_{large_mib}MiB"] = {
        "seconds": round(up, 3),
        "MiB_per_s": round(large_mib / up, 1),
    }
    result[f"download_{large_mib}MiB"] = {
        "seconds": round(down, 3),
        "MiB_per_s": round(large_mib / down, 1),
    }
    storage.delete_prefix("")
    return result


def _publish_step(storage: CheckpointStorage, files: dict[str, bytes], step: int) -> str:
    return publish_entry(storage, f"snaps/step_{step}", dict(files))


def bench_snapshot_publish(
    gcs: FakeGcs, files: int, kib: int, rtt_ms: float, repeats: int
) -> dict[str, Any]:
    """Publish an N-file snapshot sequentially (baseline) and in parallel; p50 seconds."""
    shard = os.urandom(kib * 1024)
    snapshot = {f"shard_{j:03d}.bin": shard for j in range(files)}
    result: dict[str, Any] = {"files": files, "file_KiB": kib, "rtt_ms": rtt_ms}
    with FaultProxy(gcs.url, delay_s=rtt_ms / 1e3) as proxy:
        for label, workers in (("baseline_sequential", 1), ("parallel", PARALLEL_UPLOADS)):
            prefix = f"snap-{label}-{uuid.uuid4().hex[:8]}"
            storage = GcsStorage(
                BUCKET, prefix, client=gcs.client(proxy.url), parallel_uploads=workers
            )
            samples = _timed(functools.partial(_publish_step, storage, snapshot), repeats)
            result[label] = {
                "parallel_uploads": workers,
                "p50_s": round(statistics.median(samples), 3),
            }
            storage.delete_prefix("")
    result["speedup"] = round(
        result["baseline_sequential"]["p50_s"] / result["parallel"]["p50_s"], 2
    )
    return result


def bench_interrupted_upload(gcs: FakeGcs, workdir: Path, mib: int) -> dict[str, Any]:
    """Upload ``mib`` MiB while the chunk at 3/4 fails once with 503: what goes over the wire."""
    chunk = 8 * 1024 * 1024
    src = workdir / "interrupted.bin"
    src.write_bytes(os.urandom(mib * 1024 * 1024))
    failed_at = (mib * 1024 * 1024 * 3 // 4) // chunk * chunk
    with FaultProxy(gcs.url) as proxy:
        storage = GcsStorage(BUCKET, f"int-{uuid.uuid4().hex[:8]}", client=gcs.client(proxy.url))
        proxy.fail_matching(
            lambda method, _path, headers: (
                method == "PUT"
                and headers.get("Content-Range", "").startswith(f"bytes {failed_at}-")
            ),
            status=503,
        )
        start = time.perf_counter()
        storage.upload_file("big.bin", src)
        seconds = time.perf_counter() - start
        sent = sum(n for method, _p, n in proxy.received if method == "PUT")
        sessions = sum(1 for m, p, _ in proxy.received if m == "POST" and "resumable" in p)
        storage.delete_prefix("")
    return {
        "object_MiB": mib,
        "failed_chunk_offset_MiB": failed_at // (1024 * 1024),
        "upload_sessions": sessions,
        "bytes_sent_MiB": round(sent / (1024 * 1024), 1),
        "overhead_MiB": round((sent - src.stat().st_size) / (1024 * 1024), 1),
        "seconds": round(seconds, 3),
    }


def compare(file: dict[str, Any], gs: dict[str, Any]) -> dict[str, float]:
    """gs:// over file://: p50 latency ratios (>1 is slower) and throughput ratios (<1)."""
    out: dict[str, float] = {}
    for metric, value in file.items():
        if isinstance(value, dict) and "p50_ms" in value and value["p50_ms"] > 0:
            out[f"{metric}_p50_ratio"] = round(gs[metric]["p50_ms"] / value["p50_ms"], 2)
        elif isinstance(value, dict) and "MiB_per_s" in value:
            out[f"{metric}_throughput_ratio"] = round(
                gs[metric]["MiB_per_s"] / value["MiB_per_s"], 2
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--large-mib", type=int, default=64)
    parser.add_argument("--snapshot-files", type=int, default=32)
    parser.add_argument("--snapshot-file-kib", type=int, default=512)
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="simulated round trip")
    parser.add_argument("--publish-repeats", type=int, default=3)
    args = parser.parse_args()

    report: dict[str, Any] = {
        "benchmark": "storage",
        "iterations": args.iterations,
        "note": "gs is fake-gcs-server on 127.0.0.1 (in-memory): client+HTTP overhead only",
    }
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp, FakeGcs() as gcs:
        gcs.create_bucket(BUCKET)
        work = Path(tmp)
        (work / "file-work").mkdir()
        (work / "gs_emulator-work").mkdir()
        backends = {
            "file": open_storage(f"file://{work}/store"),
            "gs_emulator": open_storage(
                f"gs://{BUCKET}/bench-{uuid.uuid4().hex[:8]}", client=gcs.client()
            ),
        }
        report["backends"] = {
            name: bench_backend(storage, work / f"{name}-work", args.iterations, args.large_mib)
            for name, storage in backends.items()
        }
        sizes = [(args.snapshot_file_kib, 0.0), (args.snapshot_file_kib, args.rtt_ms)]
        report["snapshot_publish"] = [
            bench_snapshot_publish(gcs, args.snapshot_files, kib, rtt, args.publish_repeats)
            for kib, rtt in [*sizes, (4, args.rtt_ms)]
        ]
        report["interrupted_upload"] = bench_interrupted_upload(gcs, work, args.large_mib)
        report["cpus"], report["load_average_1m"] = os.cpu_count(), os.getloadavg()[0]
    report["gs_vs_file"] = compare(report["backends"]["file"], report["backends"]["gs_emulator"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

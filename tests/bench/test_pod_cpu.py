"""bench/pod_cpu.py: a deletion's CPU by kind of pod (pure), and the sampler on this process."""

from __future__ import annotations

import time

from bench.pod_cpu import (
    MACHINE,
    THIS_PROCESS,
    PodCpuSampler,
    cpu_after_deletions,
    pod_kind,
    process_label,
    processes_after_deletions,
)

NAMES = {
    "t1": "bench-i1-trainer",
    "g0": "bench-i1-gym-0",
    "w0": "bench-i1-worker-0",
    "w1": "bench-i1-worker-1",
    "w0b": "bench-i1-worker-0",  # worker-0's replacement: same name, new uid
}


def test_the_refill_is_the_deleted_pods_new_uid_and_the_rest_go_by_role() -> None:
    assert pod_kind("bench-i1-worker-0", "w0b", "bench-i1-worker-0", "w0b") == "refill"
    assert pod_kind("bench-i1-worker-0", "w0", "bench-i1-worker-0", "w0b") == "deleted"
    assert pod_kind("bench-i1-worker-1", "w1", "bench-i1-worker-0", "w0b") == "worker"
    assert pod_kind("bench-i1-trainer", "t1", "bench-i1-worker-0", None) == "trainer"
    assert pod_kind("bench-i1-gym-0", "g0", "bench-i1-worker-0", None) == "gym"


def test_cpu_is_binned_per_deletion_and_the_lead_is_scaled_to_the_span() -> None:
    rows = [
        (100.0, "w1", 1.0),  # before the deletion: 10 s of lead
        (105.0, "t1", 2.0),
        (105.0, MACHINE, 4.0),
        (110.5, "w0b", 3.0),  # after the deletion at 110
        (111.0, "w1", 0.5),
        (112.0, THIS_PROCESS, 0.25),
        (125.0, "w0b", 9.0),  # past the 15 s span
    ]
    out = cpu_after_deletions(rows, NAMES, [(110.0, "bench-i1-worker-0", "w0b")], 15.0, 100.0)
    assert out["after_each"] == [{"bench_process": 0.25, "refill": 3.0, "worker": 0.5}]
    assert out["before_per_span"] == {"machine_busy": 6.0, "trainer": 3.0, "worker": 1.5}


def test_without_a_deletion_the_whole_sample_is_the_lead() -> None:
    rows = [(0.0, "w1", 1.0), (20.0, "t1", 3.0), (30.0, "w1", 1.0)]
    out = cpu_after_deletions(rows, NAMES, [], 15.0, 0.0)
    assert out == {
        "span_s": 15.0,
        "before_per_span": {"trainer": 1.5, "worker": 0.5},  # the row at 30 s ends it
        "after_each": [],
    }


def test_the_sampler_reads_this_process_and_the_machine() -> None:
    sampler = PodCpuSampler(dict)
    sampler.start()
    # Spend 1 s of CPU here to be seen (by CPU time, not wall time: on a loaded machine 0.8 s
    # of wall time gave this process 0.15 s); the samples every 0.25 s miss the edges.
    started, deadline = time.process_time(), time.monotonic() + 60
    while time.process_time() - started < 1.0 and time.monotonic() < deadline:
        sum(range(10_000))
    sampler.stop()
    mine = sum(spent for _, key, spent in sampler.rows if key == THIS_PROCESS)
    busy = sum(spent for _, key, spent in sampler.rows if key == MACHINE)
    assert mine >= 0.3 and busy >= mine * 0.5


def test_a_head_process_is_told_by_its_command_line() -> None:
    site = "/venv/lib/python3.11/site-packages/ray"
    assert process_label(f"{site}/core/src/ray/gcs/gcs_server --gcs_server_port=6379") == (
        "gcs_server"
    )
    assert process_label(f"{site}/core/src/ray/raylet/raylet --node_ip_address=1") == "raylet"
    assert process_label(f"python {site}/_private/log_monitor.py --gcs-address=x") == (
        "log_monitor"
    )
    assert process_label(f"python -u {site}/dashboard/agent.py --node-ip-address=x") == (
        "dashboard_agent"
    )
    assert process_label("ray::GenerationActor.start") == "actor"
    assert process_label("/venv/bin/python /venv/bin/rolloutrun trainer --config x") == "trainer"
    assert process_label("python -m rolloutrun_runtime.lease_keeper --parent 7") == ("lease_keeper")
    assert process_label("python -m ray.util.client.server --address=x") == "ray_client_server"
    assert process_label("sleep 5") == "other"


def test_the_trainer_pods_processes_are_split_per_deletion_and_the_refill_apart() -> None:
    rows = [
        (100.0, "t1", "gcs_server", 1.0),  # before the deletion at 110: 10 s of lead
        (105.0, "t1", "trainer", 4.0),
        (110.5, "t1", "raylet", 0.5),  # after it
        (111.0, "t1", "trainer", 2.0),
        (111.0, "w0b", "actor", 1.5),  # the refill's
        (111.0, "w1", "actor", 0.7),  # another worker's: neither
        (126.0, "t1", "trainer", 9.0),  # past the 15 s span
    ]
    out = processes_after_deletions(rows, NAMES, [(110.0, "bench-i1-worker-0", "w0b")], 15.0, 100.0)
    assert out["trainer_before_per_span"] == {"gcs_server": 1.5, "trainer": 6.0}
    assert out["trainer_after_each"] == [{"raylet": 0.5, "trainer": 2.0}]
    assert out["refill_after_each"] == [{"actor": 1.5}]

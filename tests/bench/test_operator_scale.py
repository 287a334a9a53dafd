"""The API load benchmark's measurement of a replacement: phases read off the API server's
commits, and a sample only once every mark of it was committed."""

from __future__ import annotations

from bench.operator_scale import phases


def test_a_replacement_is_split_into_the_operators_passes_and_the_kubelets_part():
    at = {
        ("deleted", "r-i1-trainer"): 10.1,
        ("deleting", "r-i1-gym-0"): 10.3,
        ("deleting", "r-i1-gym-1"): 10.4,
        ("deleted", "r-i1-gym-0"): 10.6,
        ("deleted", "r-i1-gym-1"): 10.5,
        ("added", "r-i2-gym-0"): 11.0,
    }
    assert phases(at, "r", 1, 10.0) == {
        "trainer_gone": 0.1,
        "gyms_deleting": 0.4,  # the later of the two: the operator's first pass done
        "gyms_gone": 0.6,
        "replacement": 1.0,
    }


def test_a_gym_deleted_without_a_grace_period_counts_as_marked_when_it_went():
    at = {
        ("deleted", "r-i3-trainer"): 5.0,
        ("deleted", "r-i3-gym-0"): 5.5,  # never seen terminating
        ("deleting", "r-i3-gym-1"): 5.2,
        ("deleted", "r-i3-gym-1"): 5.4,
    }
    assert phases(at, "r", 3, 5.0) == {
        "trainer_gone": 0.0,
        "gyms_deleting": 0.5,
        "gyms_gone": 0.5,
    }  # no replacement committed yet: no such mark


def test_each_hollow_trainer_anchors_once_a_minute_at_its_own_phase(monkeypatch):
    from bench import hollow_load

    monkeypatch.delenv("BENCH_ANCHOR_BURST", raising=False)
    renewals = [1_800_000_000 + 5.0 * k for k in range(12 * 3)]  # every 5 s for 3 minutes

    def anchored(run: str) -> list[float]:
        return [t for t in renewals if hollow_load.anchor_due(run, t)]

    runs = [f"r{index:04d}" for index in range(50)]
    assert all(len(anchored(run)) == 3 for run in runs)  # once a minute each
    phases = {anchored(run)[0] % 60 for run in runs}
    assert len(phases) > 5  # spread over the minute, not one burst
    monkeypatch.setenv("BENCH_ANCHOR_BURST", "1")
    assert {anchored(run)[0] % 60 for run in runs} == {0.0}  # the earlier generator's burst


def test_the_replacement_is_reported_with_p90_beside_p50_p99_and_max():
    from bench.scale_columns import spread

    found = spread([float(k) for k in range(1, 101)])
    assert (found["n"], found["p90"], found["p99"], found["max"]) == (100, 91.0, 100.0, 100.0)
    assert found["p99_nearest_rank"] == 99.0  # the 99th of 100: the max is not p99 by rank


def test_p99_by_nearest_rank_is_the_smallest_value_with_99_percent_at_or_below_it():
    from bench.scale_columns import nearest_rank

    values = [float(k) for k in range(1, 201)]
    assert nearest_rank(values, 0.99) == 198.0  # 198 of 200 at or below it: 99 %
    assert nearest_rank(values, 0.5) == 100.0
    assert nearest_rank([3.0], 0.99) == 3.0
    assert nearest_rank(values[:50], 0.99) == 50.0  # under 100 samples p99 is the max


def test_a_replaced_loss_is_split_into_whose_part_each_stretch_is():
    from bench.scale_columns import loss_parts

    marks = {"trainer_gone": 0.1, "gyms_deleting": 0.4, "gyms_gone": 2.9, "replacement": 3.2}
    parts = loss_parts(marks)
    assert parts == {
        "bench_delete": 0.1,
        "operator_lost_to_gyms_deleting": 0.3,
        "kubelet_gyms_deleting_to_gone": 2.5,
        "operator_gyms_gone_to_replacement": 0.3,
        "operator": 0.6,
        "end_to_end": 3.2,
    }
    stretches = [v for k, v in parts.items() if k not in ("operator", "end_to_end")]
    assert round(sum(stretches), 3) == parts["end_to_end"]
    assert loss_parts({k: v for k, v in marks.items() if k != "replacement"}) == {}


def test_the_loss_summary_spreads_each_part_over_the_replaced_losses_only():
    from bench.scale_columns import loss_parts, loss_summary

    samples = []
    for k in range(10):
        marks = {"trainer_gone": 0.1, "gyms_deleting": 0.2, "gyms_gone": 0.2 + k}
        marks["replacement"] = 0.5 + k
        samples.append({"run": f"r{k}", "lost_at": 1.0, **marks, "parts": loss_parts(marks)})
    samples.append({"run": "gone", "lost_at": 2.0, "trainer_gone": 0.1})  # never replaced
    found = loss_summary(samples)
    assert (found["n"], found["max"]) == (10, 9.5)
    assert found["parts_s"]["kubelet_gyms_deleting_to_gone"]["max"] == 9.0
    assert found["parts_s"]["operator"]["max"] == 0.4
    assert found["phases_s"]["trainer_gone"]["n"] == 10


def test_abba_runs_each_column_once_first_and_once_second():
    import pytest

    from bench.scale_columns import sequence

    assert sequence("ABBA") == [
        ("baseline", "baseline_first"),
        ("load", "baseline_first"),
        ("load", "load_first"),
        ("baseline", "load_first"),
    ]
    assert sequence("AB") == [("baseline", "baseline_first"), ("load", "baseline_first")]
    for bad in ("AAB", "AA", "ABC", ""):
        with pytest.raises(ValueError, match="--order"):
            sequence(bad)


def _half(order: str, seconds: list[float], requests: float, rss: float) -> dict:
    from bench.scale_columns import loss_parts, loss_summary

    samples = []
    for k, s in enumerate(seconds):
        marks = {"trainer_gone": 0.0, "gyms_deleting": 0.1, "gyms_gone": s - 0.1, "replacement": s}
        samples.append({"run": f"r{k}", **marks, "parts": loss_parts(marks)})
    return {
        "order": order,
        "api_requests_per_run_per_minute": requests,
        "operator_rss_mib": {"steady": rss, "peak": rss + 1},
        "pod_lost_to_replacement_s": {
            **loss_summary(samples),
            "skipped": 1,
            "missing_after_120s": [],
            "samples": samples,
        },
    }


def test_a_column_is_reported_per_order_and_combined_with_its_losses_pooled():
    from bench.scale_columns import combine

    first = _half("load_first", [0.2] * 99 + [0.3], requests=0.9, rss=500.0)
    second = _half("baseline_first", [0.5] * 99 + [5.0], requests=1.1, rss=480.0)
    found = combine([second, first])
    assert set(found["by_order"]) == {"load_first", "baseline_first"}
    assert found["by_order"]["load_first"]["pod_lost_to_replacement_s"]["p99"] == 0.3
    assert found["by_order"]["baseline_first"]["pod_lost_to_replacement_s"]["p99"] == 5.0
    combined = found["combined"]
    assert combined["orders"] == ["baseline_first", "load_first"]
    losses = combined["pod_lost_to_replacement_s"]
    assert (losses["n"], losses["max"], losses["skipped"]) == (200, 5.0, 2)
    assert losses["p50"] == 0.4  # pooled: the middle two are 0.3 (load_first) and 0.5 s
    assert losses["parts_s"]["operator"]["max"] == 0.2
    assert combined["api_requests_per_run_per_minute"] == 1.1  # the worse order's
    assert combined["operator_rss_mib"] == {"steady": 500.0, "peak": 501.0}


def test_the_goals_read_p99_both_ways_and_a_missing_spread_fails_them():
    from bench.scale_columns import combine, goals

    # 100 losses: the largest (2.5 s) is the bench's p99, the 99th (1.9 s) nearest rank's
    combined = combine([_half("load_first", [0.3] * 98 + [1.9, 2.5], 1.5, 1.0)])["combined"]
    found = goals(combined)
    assert found["api_requests_per_run_per_minute_le_2"] is True
    assert found["pod_lost_to_replacement_p99_le_2s"] is False
    assert found["pod_lost_to_replacement_p99_nearest_rank_le_2s"] is True
    combined["pod_lost_to_replacement_s"] = {"n": 0}
    assert not any(v for k, v in goals(combined).items() if k.startswith("pod_lost"))


def test_an_order_run_twice_keeps_both_halves():
    from bench.scale_columns import combine

    found = combine([_half("load_first", [0.2], 1.0, 1.0), _half("load_first", [0.4], 1.0, 1.0)])
    assert list(found["by_order"]) == ["load_first", "load_first_2"]
    assert found["combined"]["pod_lost_to_replacement_s"]["n"] == 2


def test_the_hollow_kubelets_statuses_read_as_a_kubelets_do():
    """Running and Ready serves; a deleted pod's terminal status (Failed, exit 143) is still
    the operator's own deletion, a preemption, not a member failure."""
    from bench.hollow_load import running_status, terminated_status
    from rolloutrun_operator.losses import LossKind, pod_loss, serving
    from rolloutrun_operator.observe import pod_view
    from rolloutrun_runtime.contract import pod as naming

    labels = {naming.LABEL_RUN: "r", naming.LABEL_ROLE: naming.Role.GYM}
    meta = {"name": "r-i1-gym-0", "labels": labels}
    now = "2026-01-01T00:00:00Z"
    assert serving(pod_view({"metadata": meta, "status": running_status("10.0.0.1", now)}))
    ending = {"metadata": {**meta, "deletionTimestamp": now}, "status": terminated_status(now)}
    view = pod_view(ending)
    assert (view.phase, view.exit_code, serving(view)) == ("Failed", 143, False)
    loss = pod_loss(None, view)  # type: ignore[arg-type]  # a deletion needs no pass
    assert loss is not None and loss.kind == LossKind.PREEMPTION


def test_the_hollow_watch_resumes_from_the_newest_version_bookmarks_included():
    from bench.hollow_load import newer_version

    def event(kind: str, version: str) -> dict:
        return {"type": kind, "raw_object": {"metadata": {"resourceVersion": version}}}

    assert newer_version(None, event("ADDED", "17")) == "17"
    assert newer_version("17", event("ADDED", "9")) == "17"  # a listed pod's older version
    assert newer_version("17", event("BOOKMARK", "120")) == "120"
    assert newer_version("120", event("ERROR", "")) == "120"
    assert newer_version("120", {"type": "ERROR", "raw_object": {"code": 410}}) == "120"


def _watching(core, namespace: str) -> tuple:
    """The hollow watch in a thread, re-opened every second: its stop, its ``(type, pod)``
    events so far, its thread."""
    import threading

    from bench.hollow_load import _pod_events

    stop, seen = threading.Event(), []

    def watch() -> None:
        for event in _pod_events(core, namespace, stop, reopen_s=1):
            seen.append((event["type"], event["object"].metadata.name))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return stop, seen, thread


def test_the_hollow_kubelet_resumes_its_watch_and_lists_again_only_after_410(tmp_path):
    """A re-opened watch resumes where it was, as a kubelet's informer does: it listed every
    pod again at each re-open before (3,000 pods decoded once a minute at 1,000 runs, ~2 s
    under load, with a loss's events queued behind them). After a compaction (410) it
    lists again."""
    import time

    from kubernetes import client as k8s

    from bench.hollow_load import HOLLOW
    from rolloutrun_localcluster.testing import api_client, local_cluster

    for cluster in local_cluster(tmp_path / "cluster"):
        api = api_client(cluster)
        core = k8s.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": "hw"}})
        for name in ("a", "b", "c"):
            spec = {"nodeName": HOLLOW, "containers": [{"name": "main", "image": "x"}]}
            core.create_namespaced_pod("hw", {"metadata": {"name": name}, "spec": spec})
        stop, seen, thread = _watching(core, "hw")
        listed = [("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c")]
        try:
            time.sleep(3.5)  # three re-opens or more
            assert sorted(seen) == listed
            core.create_namespaced_config_map("hw", {"metadata": {"name": "newer"}})
            cluster.compact()  # the watch's version is now older than the history: 410
            time.sleep(2.5)
        finally:
            stop.set()
            thread.join(30)
        assert not thread.is_alive()
        assert sorted(seen) == sorted(listed * 2)  # listed again once, not at every re-open
        api.close()


def test_a_hollow_renewal_the_server_never_answers_ends_at_its_deadline(monkeypatch):
    """A trainer's Lease client gives up on a request its server does not answer, and the
    next renewal tries again. The stand-in did not: a hung renewal held one of its few
    threads for good, and every other run's renewal queued behind what was left."""
    import http.server
    import threading
    import time

    from kubernetes import client as k8s

    from bench import hollow_load

    answer = threading.Event()

    class NeverAnswers(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer.wait(20)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NeverAnswers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(hollow_load, "RENEWAL_TIMEOUT_S", 0.3)
    api = k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{server.server_port}"))
    trainers = hollow_load.HollowTrainers(api, "ns")
    trainers.trainers["r0001"] = "r0001-i1-trainer/1"
    try:
        started = time.monotonic()
        trainers._renew("r0001", "r0001-i1-trainer/1")
        took = time.monotonic() - started
    finally:
        answer.set()
        trainers.close()
        server.shutdown()
        api.close()
    assert took < 5
    assert [run for _, run, _ in trainers.due] == ["r0001"]  # the next renewal is scheduled


def test_a_pass_costs_what_the_poke_added_over_the_steady_rate():
    """At 1,000 runs the five seconds after the poke hold ~80 of the other runs' requests:
    the bench reported 88-90 requests a pass, and 5.4 requests a run a minute with the
    resync, where a pass costs about 5."""
    from bench.operator_scale import pass_requests

    assert pass_requests(88, 16.5, 5.0) == 6
    assert pass_requests(5, 0.0, 5.0) == 5
    assert pass_requests(70, 16.5, 5.0) == 0  # a quieter moment than the window's mean

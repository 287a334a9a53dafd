"""Lease renewals stay out of Kopf's per-event machinery; a lost pod is replaced amid them.

Why (issue 16): at 1,000 runs the trainers renew about 170 Leases a second; through Kopf's
per-event handlers (a worker, an index handler and an event handler per event) that was a
third of a core, and a lost pod's event waited behind them (replacement p99 21 s). The
operator now streams the runs' Leases with its own label-selected watch
(:mod:`rolloutrun_operator.lease_watch`). Counted, not timed: every renewal reaches the
watch, none reaches a Kopf handler, and none wakes a pass.
"""

from __future__ import annotations

import datetime as dt
import logging

from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import naming
from rolloutrun_operator.handlers import RunMemory
from rolloutrun_operator.lease_watch import LeaseWatch, lease_key, watch_paths
from tests.support.operator_cluster import RunNamespace, operator_thread, rolloutrun

OTHER_RUNS = 8
ROUNDS = 25


def micro_time() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseRecords(logging.Handler):
    """The records Kopf's per-object logger writes about Lease objects (every handler it
    runs for an object logs there, at DEBUG for the per-event handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if (getattr(record, "k8s_ref", None) or {}).get("kind") == "Lease":
            self.records.append(record)


def test_renewals_never_reach_kopfs_handlers_and_a_lost_pod_is_replaced_amid_a_burst(cluster, api):
    ns = RunNamespace(api, "burst")
    kopf_objects = logging.getLogger("kopf.objects")
    records, level = LeaseRecords(), kopf_objects.level
    kopf_objects.addHandler(records)
    kopf_objects.setLevel(logging.DEBUG)
    try:
        with operator_thread(cluster, ns.name) as operator:
            ns.create_run(rolloutrun("b", gym_replicas=1, lease_seconds=30))
            eventually(lambda: ns.ready_condition("b").get("reason") == "Running", what="running")
            memories: dict[tuple[str, str], RunMemory] = operator.memo["memories"]
            memory = eventually(lambda: memories.get((ns.name, "b")), what="the run's memory")
            eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
            others = [f"other-{i}" for i in range(OTHER_RUNS)]
            for run in others:
                labels = {naming.LABEL_RUN: run}
                spec = {"holderIdentity": f"{run}-trainer", "leaseDurationSeconds": 30}
                meta = {"name": naming.lease_name(run), "labels": labels}
                ns.leases.create_namespaced_lease(ns.name, {"metadata": meta, "spec": spec})
            passes = memory.passes
            gym = ns.core.read_namespaced_pod("b-i1-gym-0", ns.name)
            renewed: dict[str, str] = {}
            for round_ in range(ROUNDS):  # the burst; the Gym pod is lost in its middle
                if round_ == ROUNDS // 2:
                    ns.core.delete_namespaced_pod("b-i1-gym-0", ns.name)
                for run in others:
                    renewed[run] = micro_time()
                    patch = {"spec": {"renewTime": renewed[run]}}
                    ns.leases.patch_namespaced_lease(naming.lease_name(run), ns.name, patch)

            def seen(run: str) -> str | None:
                other = memories.get((ns.name, run))
                return other.lease.renew_time if other and other.lease else None

            for run in others:  # every last renewal reached the operator ...
                eventually(lambda r=run: seen(r) == renewed[r], what=f"{run}'s last renewal")

            def replaced() -> bool:
                pods = ns.core.list_namespaced_pod(ns.name).items
                return any(
                    p.metadata.name == "b-i1-gym-0"
                    and p.metadata.uid != gym.metadata.uid
                    and p.status.phase == "Running"
                    for p in pods
                )

            eventually(replaced, what="the lost Gym pod replaced")
            assert not records.records, records.records[:3]  # ... and no Kopf handler ran
            assert memory.passes > passes  # the lost pod woke the run's pass
            for run in others:  # renewals of runs with no daemon woke nothing, decided nothing
                other = memories.get((ns.name, run))
                assert other is not None and other.passes == 0
    finally:
        kopf_objects.removeHandler(records)
        kopf_objects.setLevel(level)


def test_the_watch_keeps_only_each_runs_own_lease_and_forgets_a_deleted_one(cluster, api):
    """Through the operator's watch: a labelled Lease not named for its run is ignored, a
    run's Lease is held, and its deletion is passed on (None) and dropped."""
    ns = RunNamespace(api, "leasew")
    with operator_thread(cluster, ns.name) as operator:
        watch: LeaseWatch = operator.memo["lease_watch"]
        eventually(watch.ready.is_set, what="the Leases listed")
        labels = {naming.LABEL_RUN: "r"}
        stray = {"metadata": {"name": "not-the-runs", "labels": labels}, "spec": {}}
        own = {"metadata": {"name": naming.lease_name("r"), "labels": labels}, "spec": {}}
        ns.leases.create_namespaced_lease(ns.name, stray)
        ns.leases.create_namespaced_lease(ns.name, own)
        eventually(lambda: watch.get(ns.name, "r") is not None, what="the run's Lease")
        assert not [key for key in watch.leases if key[0] == ns.name and key[1] != "r"]
        ns.leases.delete_namespaced_lease(naming.lease_name("r"), ns.name)
        eventually(lambda: watch.get(ns.name, "r") is None, what="the Lease forgotten")
        memory = operator.memo["memories"][(ns.name, "r")]
        assert memory.lease is None


def test_lease_key_and_paths():
    lease = {"metadata": {"name": naming.lease_name("r"), "namespace": "n", "labels": {}}}
    assert lease_key(lease) is None  # no run label
    lease["metadata"]["labels"] = {naming.LABEL_RUN: "r"}
    assert lease_key(lease) == ("n", "r")
    lease["metadata"]["name"] = "other"
    assert lease_key(lease) is None
    assert [ns for ns, _ in watch_paths([])] == [None]
    assert watch_paths(["a", "b"])[1] == ("b", "/apis/coordination.k8s.io/v1/namespaces/b/leases")


async def test_a_watch_too_old_for_the_server_lists_again_and_reports_what_went(cluster, api):
    """After compaction the server answers the watch's version with 410 Gone; the watch
    lists again, and a Lease deleted meanwhile is reported gone (a run would otherwise keep
    a deadline for a Lease that no longer exists)."""
    import aiohttp

    from rolloutrun_localcluster.operator_access import operator_kubeconfig
    from rolloutrun_operator.kube import KubeError, load_credentials, permission_rules

    ns = RunNamespace(api, "relist")
    credentials = load_credentials(str(operator_kubeconfig(cluster, permission_rules())))
    told: list[tuple[str, str, bool]] = []
    watch = LeaseWatch(credentials, [ns.name], lambda n, r, lease: told.append((n, r, bool(lease))))
    namespace, path = watch.paths[0]
    labels = {naming.LABEL_RUN: "g"}
    ns.leases.create_namespaced_lease(
        ns.name, {"metadata": {"name": naming.lease_name("g"), "labels": labels}, "spec": {}}
    )
    async with aiohttp.ClientSession() as session:
        version = await watch._relist(session, namespace, path)
        assert watch.ready.is_set() and told == [(ns.name, "g", True)]
        ns.leases.delete_namespaced_lease(naming.lease_name("g"), ns.name)
        cluster.compact()
        try:
            await watch._stream(session, path, version)
            raise AssertionError("the stream of a compacted version did not end")
        except KubeError as gone:
            assert gone.status == 410, gone
        await watch._relist(session, namespace, path)
    assert told[-1] == (ns.name, "g", False) and watch.get(ns.name, "g") is None

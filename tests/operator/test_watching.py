"""What wakes a pass and what the operator keeps between passes (``watching``), on literal
API JSON."""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator import watching
from rolloutrun_operator.api.v1alpha1 import LeaseObservation
from rolloutrun_operator.plan import Action, Verb
from rolloutrun_operator.watching import RunMemory, expiry_wait, run_signature

NOW = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.UTC)


def lease(holder: str = "r-i1-trainer/1", renewed: str = "t1", **notes: str) -> dict:
    spec = {"holderIdentity": holder, "renewTime": renewed, "leaseDurationSeconds": 15}
    return {"metadata": {"name": "r-trainer", "annotations": notes}, "spec": spec}


def test_status_and_kopf_writes_do_not_change_the_runs_signature():
    run = {"metadata": {"generation": 2, "annotations": {"a": "1"}}, "status": {"x": 1}}
    written = {
        "metadata": {"generation": 2, "annotations": {"a": "1", "kopf.rolloutrun.dev/x": "y"}},
        "status": {"x": 2},
    }
    assert run_signature(run) == run_signature(written)
    suspended = {"metadata": {"generation": 3, "annotations": {"a": "1"}}}
    assert run_signature(run) != run_signature(suspended)
    memory = RunMemory(dirty=False)
    memory.saw_run(run)
    memory.dirty = False
    assert not memory.saw_run(written) and memory.saw_run(suspended)


def test_a_renewal_moves_the_deadline_and_wakes_no_pass_a_new_holder_does():
    memory = RunMemory(dirty=False)
    assert memory.saw_lease(lease(), NOW)  # first sight: a pass
    memory.dirty = False
    later = NOW + dt.timedelta(seconds=5)
    assert not memory.saw_lease(lease(renewed="t2"), later) and not memory.dirty
    assert memory.lease is not None and memory.lease.deadline() == later + dt.timedelta(seconds=17)
    assert memory.saw_lease(lease(holder="r-i2-trainer/2", renewed="t3"), later)
    assert memory.saw_lease({}, later, deleted=True) and memory.lease is None


def test_the_expiry_is_the_passes_until_a_renewal_is_seen_then_moves():
    memory = RunMemory()
    memory.saw_lease(lease(renewed="t1"), NOW)
    pass_expiry = NOW + dt.timedelta(seconds=17)
    assert expiry_wait(memory, pass_expiry, "t1", NOW) == 17.0
    memory.saw_lease(lease(renewed="t2"), NOW + dt.timedelta(seconds=10))
    assert expiry_wait(memory, pass_expiry, "t1", NOW) == 27.0
    assert expiry_wait(memory, None, "t1", NOW) == float("inf")


def test_progress_is_mirrored_once_per_change_the_train_step_alone_at_most_once_per_window():
    memory = RunMemory()
    memory.saw_lease(lease(), NOW)
    assert memory.progress_due(0.0) is None  # no annotations: nothing to mirror
    notes = {"rolloutrun.dev/train-step": "7", "rolloutrun.dev/anchor-step": "5"}
    memory.saw_lease(lease(**notes), NOW)
    assert memory.progress == {"trainStep": 7, "anchorStep": 5}
    assert memory.progress_due(0.0) == 0.0
    memory.mirrored_progress({"trainStep": 7, "anchorStep": 5, "latestManifestUri": None}, 100.0)
    assert memory.progress_due(101.0) is None  # unchanged: no request
    memory.saw_lease(lease(**{**notes, "rolloutrun.dev/train-step": "8"}), NOW)
    assert memory.progress_due(101.0) == watching.PROGRESS_MIRROR_SECONDS - 1.0
    memory.saw_lease(
        lease(**{"rolloutrun.dev/train-step": "8", "rolloutrun.dev/anchor-step": "8"}), NOW
    )
    assert memory.progress_due(101.0) == 0.0  # a new anchor: at once


def test_indexes_are_trusted_once_they_show_the_last_passes_writes():
    memory = RunMemory()
    memory.expect(
        [
            Action(Verb.CREATE, "Pod", "r-i2-trainer", manifest={}),
            Action(Verb.DELETE, "Pod", "r-i1-trainer", uid="u1"),
            Action(Verb.CREATE, "Secret", "r-gym-token", manifest={}),
        ]
    )
    old = {"metadata": {"name": "r-i1-trainer", "uid": "u1"}}
    new = {"metadata": {"name": "r-i2-trainer", "uid": "u2"}}
    assert not memory.indexes_current([old], None)  # neither write shown yet
    assert not memory.indexes_current([old, new], None)  # the deleted pod still there
    terminating = {"metadata": {"name": "r-i1-trainer", "uid": "u1", "deletionTimestamp": "x"}}
    assert memory.indexes_current([terminating, new], None)
    assert not memory.created and not memory.deleted


def test_a_pass_starts_from_the_renewal_the_operator_saw_arrive():
    memory = RunMemory()
    seen_at = NOW + dt.timedelta(seconds=3)
    memory.saw_lease(lease(renewed="t2"), seen_at)
    older = LeaseObservation(holder="r-i1-trainer/1", renew_time="t1", observed_at="x")
    got = memory.lease_for_pass(lease(renewed="t2"), older)
    assert got is not None and got.renew_time == "t2" and got.observed_at == "2026-12-01T12:00:03Z"
    same = LeaseObservation(holder="r-i1-trainer/1", renew_time="t2", observed_at="earlier")
    assert memory.lease_for_pass(lease(renewed="t2"), same) is same  # a restart keeps counting
    assert memory.lease_for_pass(lease(renewed="t3"), older) is older  # index ahead of memory


def test_an_index_older_than_the_last_pass_for_any_object_is_not_trusted():
    memory = RunMemory()

    def pod(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "resourceVersion": version}}

    memory.saw([pod("r-i1-gym-0", "5"), pod("r-i1-gym-1", "7")], None)
    # gym-1's newer event not yet handled (each object's events are handled on their own)
    assert not memory.indexes_current([pod("r-i1-gym-0", "9"), pod("r-i1-gym-1", "6")], None)
    assert not memory.indexes_current([pod("r-i1-gym-0", "9")], None)  # or not yet listed
    assert memory.indexes_current([pod("r-i1-gym-0", "9"), pod("r-i1-gym-1", "7")], None)


def test_only_a_deleted_static_child_of_a_known_run_makes_a_pass_due():
    assert watching.child_event_needs_pass("DELETED", run_known=True)
    assert not watching.child_event_needs_pass("DELETED", run_known=False)  # run going
    for quiet in (None, "ADDED", "MODIFIED"):  # the initial listing, the operator's creates
        assert not watching.child_event_needs_pass(quiet, run_known=True)
    assert "Secret" not in watching.WATCHED_CHILD_KINDS  # no list/watch on Secrets


def test_a_lost_member_makes_a_pass_due_at_once_whatever_the_renewal_clock_says():
    memory = RunMemory(dirty=False)
    memory.saw_lease(lease("h/1", "t0"), NOW)
    memory.dirty = False  # the pass that saw the holder is done
    renewed = lease("h/1", "t1")
    assert not memory.saw_lease(renewed, NOW)  # a renewal: no pass, the expiry moves
    assert watching.idle_step(memory.dirty, 1200.0, 17.0, None) == 17.0  # idle until expiry
    memory.dirty = True  # a member pod's DELETED event (handlers.pass_due)
    assert not memory.saw_lease(lease("h/1", "t2"), NOW)
    assert memory.dirty  # a renewal arriving meanwhile does not take the pass back
    assert watching.idle_step(memory.dirty, 1200.0, 17.0, 60.0) == 0.0  # the pass: now


def test_idle_mirrors_progress_without_a_pass_and_waits_for_the_nearest_deadline():
    assert watching.idle_step(False, 30.0, 10.0, 0.0) == -1.0
    assert watching.idle_step(False, 30.0, 10.0, 4.0) == 4.0
    assert watching.idle_step(False, 30.0, 0.0, 4.0) == 0.0  # the Lease's expiry: a pass
    assert watching.idle_step(False, -1.0, 10.0, None) == 0.0  # the requeue came


def test_indexed_static_children_are_trusted_once_they_show_a_replace():
    memory = RunMemory()

    def config(version: str) -> dict:
        return {"metadata": {"name": "r-config", "resourceVersion": version}}

    memory.saw([], None, {"ConfigMap/r-config": config("5"), "Service/r-gym": None})
    memory.expect([Action(Verb.REPLACE, "ConfigMap", "r-config", manifest={})])
    assert not memory.indexes_current([], None, {})  # gone from the index: read the API
    assert not memory.indexes_current([], None, {"ConfigMap/r-config": config("5")})  # old
    assert memory.indexes_current([], None, {"ConfigMap/r-config": config("6")})
    assert not memory.replaced


def test_kopfs_per_event_success_lines_move_to_debug_and_nothing_else_does():
    """Kopf logs "Handler '...' succeeded." at INFO for every watch event it hands to a
    handler (a Lease renewal, a pod's status): tens of lines a second at a thousand runs.
    Those of the per-event handlers go to DEBUG; failures and the daemon's lines stay."""
    import logging

    from rolloutrun_operator.handlers import registry

    ids = {handler.id for handler in registry._watching.get_all_handlers()}
    assert ids == watching.EVENT_HANDLERS  # every per-event handler, named as Kopf names it
    logger = logging.getLogger(f"test-kopf-objects-{id(ids)}")
    logger.setLevel(logging.DEBUG)
    records: list[logging.LogRecord] = []
    catcher = logging.Handler()
    catcher.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(catcher)
    watching.quiet_event_handlers(logger)
    watching.quiet_event_handlers(logger)  # installed once
    assert len(logger.filters) == 1
    logger.info("Handler 'member_changed' succeeded.")
    logger.info("Handler 'child_deleted/Service' succeeded.")
    logger.info("Daemon 'keep_running' succeeded.")
    logger.error("Handler 'member_changed' failed with an exception and will try again")
    logger.info("Handler 'somebody_elses' succeeded.")
    levels = [(record.getMessage()[:22], record.levelname) for record in records]
    assert levels == [
        ("Handler 'member_change", "DEBUG"),
        ("Handler 'child_deleted", "DEBUG"),
        ("Daemon 'keep_running' ", "INFO"),
        ("Handler 'member_change", "ERROR"),
        ("Handler 'somebody_else", "INFO"),
    ]
    logger.setLevel(logging.INFO)  # as the operator runs without --verbose: not shown
    logger.info("Handler 'member_changed' succeeded.")
    logger.info("Daemon 'keep_running' succeeded.")
    assert [record.getMessage()[:6] for record in records[5:]] == ["Daemon"]


def test_a_pass_reading_the_pods_from_the_api_still_trusts_the_current_children():
    memory = RunMemory()

    def child(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "resourceVersion": version}}

    memory.saw([], None, {"Service/r-gym": child("r-gym", "5"), "Role/r-member": child("m", "4")})
    memory.expect([Action(Verb.REPLACE, "ConfigMap", "r-config", manifest={})])
    indexed = {
        "Service/r-gym": child("r-gym", "5"),  # as the last pass saw it: trusted
        "Role/r-member": child("r-member", "3"),  # older than the last pass saw: read
        "ConfigMap/r-config": child("r-config", "9"),  # replaced by the last pass: read
    }
    assert memory.current_children(indexed) == {"Service/r-gym": child("r-gym", "5")}
    assert memory.current_children(None) is None


def test_a_pass_starts_from_the_watched_run_only_when_it_shows_the_last_status_write():
    """Without a GET only while the last watch event of the run is not older than this
    operator's last status write: an older one would let a pass count incarnations again."""
    memory = RunMemory()
    body = {"metadata": {"name": "r", "resourceVersion": "41"}, "status": {"incarnation": 1}}
    memory.run_body = body
    assert memory.watched_run() is None  # no write known yet (a fresh operator): read it
    memory.run_version = "42"
    assert memory.watched_run() is None  # the watch has not shown the write yet
    memory.run_body = {**body, "metadata": {"name": "r", "resourceVersion": "42"}}
    assert memory.watched_run() == memory.run_body
    memory.run_version = None  # a write that failed may have landed: read it
    assert memory.watched_run() is None


def test_a_pass_made_due_keeps_the_time_of_the_first_event_and_its_line_splits_it():
    memory = RunMemory(dirty=False)
    memory.make_due(100.0)
    memory.make_due(100.5)
    assert memory.dirty and memory.due_since == 100.0
    reads = [("GET secrets/r-gym-token", 0.0123), ("GET nodes/n1", 0.4)]
    line = watching.pass_timing(memory.due_since, 100.25, 101.0, 101.5, 2, reads)
    assert line == (
        "2 action(s) in 0.500 s; due at 100.000 (0.250 s before it queued); "
        "0.750 s waiting for a pass slot; reads: GET secrets/r-gym-token 0.012 s, "
        "GET nodes/n1 0.400 s"
    )
    assert watching.pass_timing(None, 1.0, 1.0, 2.0, 1).endswith("; reads: none")
    assert "due by a deadline" in watching.pass_timing(None, 1.0, 1.0, 2.0, 1)


def test_reads_are_named_by_resource_and_object():
    from rolloutrun_operator.kube import read_name

    assert (
        read_name("GET", "/api/v1/namespaces/ns/secrets/r-gym-token") == "GET secrets/r-gym-token"
    )
    assert read_name("GET", "/api/v1/namespaces/ns/pods") == "LIST pods"
    assert read_name("GET", "/api/v1/nodes/n1") == "GET nodes/n1"
    run = "/apis/rolloutrun.dev/v1alpha1/namespaces/ns/rolloutruns/r"
    assert read_name("GET", run) == "GET rolloutruns/r"
    assert read_name("GET", "/apis/kueue.x-k8s.io/v1beta1/resourceflavors/f") == (
        "GET resourceflavors/f"
    )


def test_a_member_whose_deletion_was_watched_does_not_make_the_index_look_stale():
    """A lost pod leaves its index: the pass that saw it must still trust the indexes (a
    lost pod's reaction read everything from the API, on the replacement's path); one
    merely missing (not yet listed) still is not trusted."""
    memory = RunMemory()

    def pod(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "resourceVersion": version}}

    memory.saw([pod("r-i1-trainer", "5"), pod("r-i1-gym-0", "7")], None)
    assert not memory.indexes_current([pod("r-i1-gym-0", "7")], None)
    memory.watched("Pod", "r-i1-trainer", deleted=True)
    assert memory.indexes_current([pod("r-i1-gym-0", "7")], None)
    memory.saw([pod("r-i1-trainer", "5"), pod("r-i1-gym-0", "7")], None)
    memory.watched("Pod", "r-i1-trainer", deleted=False)  # re-added under that name
    assert not memory.indexes_current([pod("r-i1-gym-0", "7")], None)


def test_an_unindexed_child_read_moments_ago_is_reused_until_acted_on_or_old():
    memory = RunMemory()
    secret = {"metadata": {"name": "r-gym-token", "resourceVersion": "3"}}
    memory.saw([], None, {"Secret/r-gym-token": secret, "Secret/r-other": None, "Node/n": {}})
    now = memory.read["Secret/r-gym-token"][0]
    assert memory.recent_reads(now + 1.0) == {"Secret/r-gym-token": secret, "Node/n": {}}
    assert memory.recent_reads(now + watching.RECENT_READ_SECONDS + 1.0) == {}
    assert ("Secret", "r-gym-token") not in memory.seen  # not an index's: no staleness check
    memory.expect([Action(Verb.DELETE, "Secret", "r-gym-token")])
    assert memory.recent_reads(now + 1.0) == {"Node/n": {}}


def test_the_runs_body_from_a_status_write_serves_until_the_watch_catches_up():
    """A lost pod's second pass began before the watch showed the first pass's status
    write, and read the run again; the write's answer is that body."""
    memory = RunMemory()
    memory.run_body = {"metadata": {"resourceVersion": "5"}}
    written = {"metadata": {"resourceVersion": "8"}, "status": {"incarnation": 2}}
    memory.run_version = "8"
    assert memory.watched_run() is None  # the watch lags the write: today a GET
    memory.wrote_run(written)
    assert memory.watched_run() == written
    memory.run_body = {"metadata": {"resourceVersion": "9"}}  # a later event wins
    memory.wrote_run(written)
    assert memory.watched_run() == {"metadata": {"resourceVersion": "9"}}
    memory.wrote_run(None)  # no write: nothing changes
    assert memory.watched_run() == {"metadata": {"resourceVersion": "9"}}


def test_a_pass_looks_again_at_a_lagging_index_before_reading_everything(monkeypatch):
    """The index one event behind the last pass (the other Gym's deletion not yet
    handled): the pass waits for that event, it does not read the run's children from the
    API (a dozen reads, on a lost pod's path); an index that never catches up is given up
    on after the bound."""
    import asyncio
    from types import SimpleNamespace

    monkeypatch.setattr(watching, "INDEX_POLL_SECONDS", 0.0)
    memory = RunMemory()

    def pod(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "resourceVersion": version}}

    memory.saw([pod("r-i1-gym-0", "5"), pod("r-i1-gym-1", "7")], None)
    views = [[pod("r-i1-gym-0", "9"), pod("r-i1-gym-1", "6")]] * 3
    views.append([pod("r-i1-gym-0", "9"), pod("r-i1-gym-1", "8")])
    looked: list[int] = []

    def current() -> SimpleNamespace:
        looked.append(1)
        view = views[min(len(looked), len(views)) - 1]
        return SimpleNamespace(pods=view, lease=None, children={})

    assert asyncio.run(watching.index_catch_up(memory, False, current, bound=60.0))
    assert len(looked) == 4
    memory.saw([pod("r-i1-gym-0", "9"), pod("r-i1-gym-1", "8")], None)
    looked.clear()
    views[:] = [[pod("r-i1-gym-0", "9")]]  # gym-1 missing, its deletion never watched
    assert not asyncio.run(watching.index_catch_up(memory, False, current, bound=0.0))
    assert len(looked) == 1

"""A trainer cut off from the network (alive, not frozen) loses its Lease and is fenced.

The partition (``LocalCluster.partition``, namespace mode) cuts the trainer pod's links
while it keeps running: it can renew nothing, the operator sees the Lease unchanged for
leaseDurationSeconds (+ its 2 s margin) of its own clock and starts a new incarnation, and
the cut-off trainer, still computing, publishes nothing after that: checked from storage,
where every manifest and trainer-checkpoint marker names the incarnation that wrote it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster import netns
from rolloutrun_localcluster.embedded import EmbeddedRun
from rolloutrun_localcluster.testing import eventually
from tests.e2e.conftest import TINY, assert_recovered_cleanly, finish, tiny, wait_for_snapshot

pytestmark = pytest.mark.skipif(
    netns.namespaces_unavailable() is not None,
    reason=f"no network namespaces here: {netns.namespaces_unavailable()}",
)

LEASE_S = TINY["spec"]["recovery"]["leaseDurationSeconds"]
#: The operator's own margin past leaseDurationSeconds (losses.LEASE_EXPIRY_MARGIN_SECONDS).
MARGIN_S = 2
TRAINER = "tiny-i1-trainer"


def _time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def published_by_incarnation(storage: Path) -> list[tuple[int, dt.datetime, str]]:
    """(incarnation, commit time, entry) of every committed manifest and checkpoint."""
    found = []
    markers = [
        *storage.glob("rollout_snapshots/*/MANIFEST.json"),
        *storage.glob("step_*/COMMITTED"),
    ]
    for marker in markers:
        data: Any = json.loads(marker.read_text())
        incarnation = data.get("incarnation") if marker.name == "MANIFEST.json" else None
        if incarnation is None:
            incarnation = (data.get("writer") or {}).get("incarnation")
        when = dt.datetime.fromtimestamp(marker.stat().st_mtime, dt.UTC)
        found.append((int(incarnation), when, marker.parent.name))
    return sorted(found)


@pytest.mark.chaos  # minutes on two cores: `make chaos` (the default suite stays under 15 min)
def test_a_partitioned_trainer_loses_its_lease_and_publishes_nothing_after(start_run):
    document = tiny()
    document["spec"]["run"]["checkpointing"]["keepLatest"] = 1000  # every entry stays to audit
    run: EmbeddedRun = start_run(document, cluster_options={"network": "namespaces"})
    wait_for_snapshot(run)
    assert run.cluster is not None
    last_renewal = run.lease().spec.renew_time
    run.cluster.partition(pod=TRAINER, seconds=60)
    pids = run.pod_pids(TRAINER)

    def acted() -> dict[str, Any] | None:
        nonlocal last_renewal
        lease = run.lease()
        if lease.spec.holder_identity == f"{TRAINER}/1" and lease.spec.renew_time:
            last_renewal = max(last_renewal, lease.spec.renew_time)
        status = run.status()
        return status if (status.get("lastFailure") or {}).get("pod") == TRAINER else None

    status = eventually(acted, timeout=120, interval=0.1, what="the operator acting")
    seen = (dt.datetime.now(dt.UTC) - last_renewal).total_seconds()  # an upper bound
    # Cut off, not frozen: the trainer's processes were running when the operator acted.
    assert [pid for pid in pids if _state(pid) not in ("T", "Z")], "the trainer was frozen"
    failure = status["lastFailure"]
    assert failure["reason"] == "LeaseExpired"
    acted_at = _time(failure["time"])  # whole seconds, rounded down
    waited = (acted_at - last_renewal).total_seconds()
    print(f"operator acted {waited:.2f} s (status, whole seconds) to {seen:.2f} s (seen) after")
    assert waited <= LEASE_S + MARGIN_S, (last_renewal, acted_at)
    assert seen <= LEASE_S + MARGIN_S + 1, seen  # + the poll and the API round trip
    eventually(lambda: run.status().get("incarnation") == 2, timeout=120, what="incarnation 2")
    eventually(
        lambda: run.lease_holder() == "tiny-i2-trainer/2", timeout=120, what="the Lease taken"
    )

    summary = finish(run)
    assert_recovered_cleanly(run, summary, from_snapshot=False)
    assert summary["restarts"] == 1  # an unreachable trainer is a failure, not a preemption
    entries = published_by_incarnation(run.storage_dir)
    assert all(entry[0] >= 1 for entry in entries), entries  # each names its writer
    first = [entry for entry in entries if entry[0] == 1]
    assert first and [entry for entry in entries if entry[0] >= 2], entries
    late = [entry for entry in first if entry[1] >= acted_at]
    assert not late, f"the fenced trainer published after the operator acted: {late}"
    print(f"{len(first)} entries of incarnation 1, {len(entries) - len(first)} later ones")

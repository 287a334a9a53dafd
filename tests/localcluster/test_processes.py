"""A pod's kill sweep signals only the pod's own processes, even after session ids are reused.

The kubelet keeps the session of every container a pod ever started and sweeps them when the
pod dies. A session number is free again once its processes are gone, and another pod's
container (or any process that calls ``setsid``) may lead a session of that number: sweeping
it then would kill somebody else's processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rolloutrun_localcluster import processes
from rolloutrun_localcluster.testing import eventually


@pytest.fixture
def other_pods_session() -> Iterator[subprocess.Popen[bytes]]:
    """A process leading its own session, tagged as another pod's."""
    env = {**os.environ, processes.POD_TAG: "other-pod"}
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_process_of_another_pod_in_a_listed_session_is_not_ours(
    other_pods_session: subprocess.Popen[bytes],
) -> None:
    sid = other_pods_session.pid
    assert sid not in processes.tagged_pids(processes.pod_tag("my-pod"), [sid])
    assert sid in processes.tagged_pids(processes.pod_tag("other-pod"), [sid])


def test_an_untagged_process_in_a_listed_session_is_ours() -> None:
    """What a container started with a cleared environment is still found by its session."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROLLOUTRUN")}
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    try:
        assert child.pid in processes.tagged_pids(processes.pod_tag("my-pod"), [child.pid])
    finally:
        child.kill()
        child.wait()


def test_a_session_number_leading_a_later_process_is_dropped(
    other_pods_session: subprocess.Popen[bytes],
) -> None:
    sessions = processes.Sessions()
    sessions.add(other_pods_session.pid)
    assert list(sessions) == [other_pods_session.pid]
    # As if the number had been recorded for an earlier leader that has since exited and
    # the number was handed to this process: its start time differs from the recorded one.
    sessions._leaders[other_pods_session.pid] = processes.start_ticks(os.getpid())
    assert processes.start_ticks(os.getpid()) != processes.start_ticks(other_pods_session.pid)
    assert list(sessions) == []
    assert processes.kill_tagged(processes.pod_tag("my-pod"), sessions) == 0
    assert other_pods_session.poll() is None


def test_a_session_whose_leader_is_gone_is_still_swept() -> None:
    """Linux reuses no session number while a process is in it: the leader's exit alone does
    not make the session somebody else's."""
    script = (
        "import subprocess, sys; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(c.pid, flush=True)"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    sessions = processes.Sessions()
    sessions.add(leader.pid)
    assert leader.stdout is not None
    orphan = int(leader.stdout.readline())
    leader.wait()
    assert list(sessions) == [leader.pid]
    assert orphan in processes.tagged_pids(processes.pod_tag("my-pod"), sessions)
    processes.kill_tagged(processes.pod_tag("my-pod"), sessions)
    eventually(
        lambda: orphan not in processes.tagged_pids(processes.pod_tag("my-pod"), sessions) or None,
        what="the orphan killed",
    )

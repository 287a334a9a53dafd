"""SharedReads, the single-flight fresh read of the Lease, on its own: each caller's answer
comes from a read begun after it asked, and callers at once share one (the fence is decided
by such a read; with the real API server: test_lease_concurrency.py)."""

from __future__ import annotations

import threading
import time

from rolloutrun_runtime.coordination import LeaseRecord, SharedReads

from .slow_api import in_thread


class Store:
    """A Lease whose reads the test lets through one at a time (``go``)."""

    def __init__(self) -> None:
        self.holder = "a/1"
        self.reads = 0
        self.go = threading.Semaphore(0)
        self.began = threading.Semaphore(0)
        self.fail = False

    def read(self) -> LeaseRecord:
        self.reads += 1
        seen = self.holder  # the state when the read begins
        self.began.release()
        self.go.acquire()
        if self.fail:
            raise OSError("unreachable")
        return LeaseRecord(holder=seen)


def test_callers_asking_during_a_read_share_the_next_one_not_the_one_in_flight():
    store = Store()
    reads = SharedReads(store.read)
    first, early = in_thread(reads)
    assert store.began.acquire(timeout=10)
    store.holder = "b/2"  # changed after the first read began
    later = [in_thread(reads) for _ in range(8)]
    time.sleep(0.5)  # a wait for the eight to ask, not a timed assertion
    store.go.release()
    first.join(10)
    assert early[0].holder == "a/1"
    assert store.began.acquire(timeout=10)  # one more read, for all eight
    store.go.release()
    for thread, _ in later:
        thread.join(10)
    assert [out[0].holder for _, out in later] == ["b/2"] * 8
    assert store.reads == 2


def test_a_failed_read_fails_each_caller_that_shared_it_and_the_next_read_is_new():
    store = Store()
    reads = SharedReads(store.read)
    store.fail = True
    calls = [in_thread(reads) for _ in range(3)]
    for _ in range(3):
        store.go.release()
    for thread, _ in calls:
        thread.join(10)
    assert all(isinstance(out[0], OSError) for _, out in calls)
    store.fail = False
    before = store.reads
    store.go.release()
    assert reads().holder == "a/1" and store.reads == before + 1  # not an old failure

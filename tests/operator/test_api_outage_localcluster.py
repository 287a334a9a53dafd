"""A pass that got no answer from the API is retried within seconds once it answers again.

Against the local cluster, through a loopback TCP relay the test can make stop answering
(connections closed at once, those open cut): the passes of a run fail while it does, and
back off 1 s doubling to 30 s with jitter, not the 5 s doubling to 5 min of an error the API
answered (nothing else wakes the run when it answers again: its watches broke too); once
it answers, the run's next pass succeeds without a change of the run waking it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from rolloutrun_localcluster.kubeconfig import write_private
from rolloutrun_localcluster.operator_access import operator_kubeconfig
from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import handlers
from rolloutrun_operator.handlers import Options
from rolloutrun_operator.kube import permission_rules
from rolloutrun_operator.runner import OperatorConfig, OperatorThread
from rolloutrun_operator.watching import RunMemory
from tests.support.operator_cluster import RunNamespace, rolloutrun


class Relay:
    """A TCP relay on loopback to ``upstream``; :meth:`silence` closes every connection and
    each new one at once (the API server down), :meth:`answer` relays again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.answering = True
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.answering:
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                end.close()

    def silence(self) -> None:
        self.answering = False
        with self.lock:
            cut, self.open = self.open, []
        for end in cut:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()

    def answer(self) -> None:
        self.answering = True

    def close(self) -> None:
        self.listener.close()
        self.silence()


@pytest.fixture
def relay(cluster: Any) -> Iterator[Relay]:
    api = urlsplit(cluster.api_url)
    relayed = Relay((api.hostname or "127.0.0.1", api.port or 443))
    yield relayed
    relayed.close()


def relayed_kubeconfig(cluster: Any, relay: Relay) -> Path:
    """The operator's kubeconfig (the chart's rules), its server the relay."""
    path = operator_kubeconfig(cluster, permission_rules())
    config = yaml.safe_load(path.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    relayed = path.with_name(f"relayed-{relay.port}.kubeconfig")
    write_private(relayed, yaml.safe_dump(config).encode())
    return relayed


def test_passes_without_an_answer_retry_within_seconds_and_resume_when_it_answers(
    cluster: Any, api: Any, relay: Relay
) -> None:
    ns = RunNamespace(api, "outage")
    options = Options(kubeconfig=str(relayed_kubeconfig(cluster, relay)))
    with OperatorThread(OperatorConfig(options=options, namespaces=[ns.name])) as operator:
        ns.create_run(rolloutrun("o", gym_replicas=1, lease_seconds=30))
        eventually(lambda: ns.ready_condition("o").get("reason") == "Running", what="running")
        memories: dict[tuple[str, str], RunMemory] = operator.memo["memories"]
        memory = eventually(lambda: memories.get((ns.name, "o")), what="the run's memory")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        relay.silence()
        loop = operator.memo["lease_task"].get_loop()
        loop.call_soon_threadsafe(handlers.pass_due, operator.memo, ns.name, "o")
        eventually(lambda: memory.failures >= 3, what="three passes without an answer")
        assert memory.retry_in is not None
        assert memory.retry_in <= handlers.NO_ANSWER_RETRY_SECONDS * 4, memory.retry_in
        failed = memory.passes
        relay.answer()
        eventually(lambda: memory.passes > failed and memory.failures == 0, what="a pass")
        assert ns.ready_condition("o").get("reason") == "Running"


def test_only_a_pass_without_an_answer_backs_off_briefly() -> None:
    from rolloutrun_operator.kube import KubeError

    silent = KubeError("GET /api/v1/nodes/n: Connection reset by peer")
    silent.unanswered = True
    answered = KubeError("GET /api/v1/nodes/n: 500 etcd leader changed", 500)
    assert [handlers.failure_delay(silent, n, 1.0) for n in (1, 2, 3, 9)] == [1.0, 2.0, 4.0, 30.0]
    assert handlers.failure_delay(silent, 9, 0.5) == 15.0  # jittered: runs not in step
    assert handlers.failure_delay(answered, 9, 0.5) == handlers.MAX_RETRY_SECONDS
    assert handlers.failure_delay(RuntimeError("bug"), 1, 0.5) == handlers.RETRY_SECONDS

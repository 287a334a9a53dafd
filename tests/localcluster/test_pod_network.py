"""Each pod its own network (namespace mode): its own address and ports, links that die with
the pod, a partition that cuts them while the pod keeps running.

On the shared loopback a pod listening on ``0.0.0.0`` takes the port at every pod IP, so a
dead pod's address still answers and two pods cannot use one port; no link can be cut.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rolloutrun_localcluster import netns
from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import api_client, eventually, local_cluster
from tests.support.kube_objects import grant_pod_listing

PY = sys.executable

pytestmark = pytest.mark.skipif(
    netns.namespaces_unavailable() is not None,
    reason=f"no network namespaces here: {netns.namespaces_unavailable()}",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    directory: Path = tmp_path_factory.mktemp("netns-cluster")
    yield from local_cluster(directory, restart_backoff=(0.2, 2.0), network="namespaces")


@pytest.fixture(scope="module")
def core(cluster: LocalCluster) -> Iterator[Any]:
    api = api_client(cluster)
    yield k8s.CoreV1Api(api)
    api.close()


def _pod(name: str, code: str, *args: str, **container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": "x", "command": [PY, "-c", code, *args], **container}
            ],
        },
    }


def _status(core: Any, name: str, *phases: str) -> Any:
    pod = core.read_namespaced_pod(name, "default")
    return pod if pod.status.phase in phases else None


def _ready(core: Any, name: str) -> Any:
    pod = core.read_namespaced_pod(name, "default")
    ready = {c.type: c.status for c in pod.status.conditions or []}.get("Ready")
    return pod if ready == "True" else None


def _log(core: Any, name: str) -> str:
    return core.read_namespaced_pod_log(name, "default")


def _finished(core: Any, name: str) -> str:
    pod = eventually(lambda: _status(core, name, "Succeeded", "Failed"), what=f"{name} done")
    log = _log(core, name)
    assert pod.status.phase == "Succeeded", log
    return log


#: Answers its pod name on 0.0.0.0:8080 (every address of the pod, as servers usually bind).
SERVE = """
import http.server, os
class Name(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ["HOSTNAME"].encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
http.server.HTTPServer(("0.0.0.0", 8080), Name).serve_forever()
"""
PROBE = {"readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}}

#: Fetches each pod IP given and lists the pods at KUBERNETES_SERVICE_HOST:_PORT with the
#: pod's service-account token and CA (as in-cluster clients do).
FETCH = """
import json, os, sys, urllib.request
from kubernetes import client
names = [urllib.request.urlopen(f"http://{ip}:8080/", timeout=10).read().decode()
         for ip in sys.argv[1:]]
account = os.path.join(os.environ["ROLLOUTRUN_LOCALCLUSTER_POD_DIR"], "serviceaccount")
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
config = client.Configuration(host=f"https://{host}:{port}")
config.ssl_ca_cert = os.path.join(account, "ca.crt")
config.api_key = {"authorization": "Bearer " + open(os.path.join(account, "token")).read()}
api = client.CoreV1Api(client.ApiClient(config))
pods = [p.metadata.name for p in api.list_namespaced_pod("default").items]
print(json.dumps({"names": names, "pods": sorted(pods), "api": host, "ip": os.environ["POD_IP"]}))
"""


def test_two_pods_serve_one_port_at_their_own_ips_and_reach_the_api(core: Any) -> None:
    grant_pod_listing(core, "default")  # the fetching pod lists pods with its token
    for name in ("web-a", "web-b"):
        core.create_namespaced_pod("default", _pod(name, SERVE, **PROBE))
    ips = [
        eventually(lambda n=name: _ready(core, n), what=f"{name} ready").status.pod_ip
        for name in ("web-a", "web-b")
    ]
    core.create_namespaced_pod("default", _pod("fetch", FETCH, *ips))
    report = json.loads(_finished(core, "fetch").strip().splitlines()[-1])
    assert report["names"] == ["web-a", "web-b"]  # each pod's own 8080, by its own IP
    assert {"web-a", "web-b", "fetch"} <= set(report["pods"])
    assert report["api"] == "127.0.0.1"  # the pod's loopback relays to the API server
    fetch = core.read_namespaced_pod("fetch", "default")
    assert report["ip"] == fetch.status.pod_ip and report["ip"] not in ips
    for name in ("web-a", "web-b", "fetch"):
        core.delete_namespaced_pod(name, "default")


#: Holds one connection to argv[1]:8080 open; says when it is up and when it ended.
HOLD = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 8080), timeout=5)
print("connected", flush=True)
s.settimeout(None)
s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
for option, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2)):
    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
try:
    data = s.recv(1)
    print("ended", repr(data), flush=True)
except OSError as error:
    print("ended", type(error).__name__, flush=True)
"""
#: Tries one connection to argv[1]:8080: prints "answered" or "no answer".
KNOCK = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 8080), timeout=3).close()
    print("answered")
except OSError as error:
    print("no answer", type(error).__name__)
"""
#: A bare TCP server on 0.0.0.0:8080 that never writes (connections stay open and silent).
SILENT = """
import socket, time
server = socket.create_server(("0.0.0.0", 8080))
held = []
while True:
    held.append(server.accept()[0])
"""


def test_a_dead_pods_connections_end_and_its_address_answers_nothing(
    cluster: LocalCluster, core: Any
) -> None:
    tcp = {"readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}
    core.create_namespaced_pod("default", _pod("doomed", SILENT, **tcp))
    doomed = eventually(lambda: _ready(core, "doomed"), what="doomed ready")
    ip, uid = doomed.status.pod_ip, doomed.metadata.uid
    core.create_namespaced_pod("default", _pod("holder", HOLD, ip))
    eventually(lambda: "connected" in _log(core, "holder"), what="holder connected")
    core.delete_namespaced_pod("doomed", "default")
    eventually(lambda: "ended" in _log(core, "holder"), what="the held connection ended")
    # Another pod serving the same port answers at its own address only, not at the
    # dead pod's (on a shared loopback its wildcard listener takes every address).
    core.create_namespaced_pod("default", _pod("heir", SILENT, **tcp))
    eventually(lambda: _ready(core, "heir"), what="heir ready")
    core.create_namespaced_pod("default", _pod("knock", KNOCK, ip))
    assert _finished(core, "knock").strip().startswith("no answer")
    # Its network namespace went with it.
    assert cluster.network is not None
    assert cluster.call(lambda: uid not in getattr(cluster.network, "pods", {}))
    for name in ("holder", "heir", "knock"):
        core.delete_namespaced_pod(name, "default")


#: Every 0.2 s: one HTTPS request to the API server (any HTTP answer counts as reached) and
#: one fetch from the peer at argv[1], each with a 0.5 s timeout; prints ok/cut per line.
PULSE = """
import os, ssl, sys, time, urllib.error, urllib.request
api = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
tls = ssl._create_unverified_context()
def reached(url, **kw):
    try:
        urllib.request.urlopen(url, timeout=0.5, **kw).read()
    except urllib.error.HTTPError:
        pass
    except Exception:
        return "cut"
    return "ok"
while True:
    api_ok = reached(api + "/version", context=tls)
    peer_ok = reached(f"http://{sys.argv[1]}:8080/")
    print(f"{time.time():.2f} api={api_ok} peer={peer_ok}", flush=True)
    time.sleep(0.2)
"""


def _pulses(log: str) -> list[tuple[float, str]]:
    lines = [line.split(" ", 1) for line in log.splitlines() if " api=" in line]
    return [(float(when), what) for when, what in lines]


def test_a_partitioned_pod_keeps_running_cut_off_then_heals(
    cluster: LocalCluster, core: Any
) -> None:
    core.create_namespaced_pod("default", _pod("peer", SERVE, **PROBE))
    peer = eventually(lambda: _ready(core, "peer"), what="peer ready").status.pod_ip
    core.create_namespaced_pod("default", _pod("pulse", PULSE, peer))
    eventually(lambda: "api=ok peer=ok" in _log(core, "pulse"), what="pulse connected")
    cut_at = time.time()
    done = cluster.partition(pod="pulse", seconds=6)
    assert (done.pods, done.mode) == (("default/pulse",), "links")
    healed_at = cut_at + 6

    def healed_again() -> bool:
        return any(
            when > healed_at and what == "api=ok peer=ok"
            for when, what in _pulses(_log(core, "pulse"))
        )

    eventually(healed_again, timeout=60, what="pulse reconnected after the partition")
    during = [what for when, what in _pulses(_log(core, "pulse")) if cut_at + 1 < when < healed_at]
    # It kept running (lines printed while cut off), and reached neither the API nor its peer.
    assert during and set(during) == {"api=cut peer=cut"}, during
    assert _ready(core, "pulse") is not None  # the kubelet still sees it: only links are cut
    for name in ("peer", "pulse"):
        core.delete_namespaced_pod(name, "default")


def test_partition_refuses_unknown_targets(cluster: LocalCluster) -> None:
    with pytest.raises(ValueError, match="exactly one of pod= or node="):
        cluster.partition(seconds=1)
    with pytest.raises(ValueError, match="is not running"):
        cluster.partition(pod="nobody", seconds=1)
    with pytest.raises(ValueError, match="must be positive"):
        cluster.partition(node="local", seconds=0)


def test_namespaces_are_removed_with_the_cluster_and_stale_ones_at_start(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    prefix = f"{netns.PREFIX}{netns.cluster_id(str(directory.resolve()))}-"
    leftover = f"{prefix}999999-p1"  # as a crashed session leaves it
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    with LocalCluster(directory, network="namespaces") as cluster:
        assert leftover not in netns.list_namespaces()
        assert cluster.network is not None and cluster.network.mode == "namespaces"
        assert [n for n in netns.list_namespaces() if n.startswith(prefix)]
    assert not [n for n in netns.list_namespaces() if n.startswith(prefix)]


def test_the_mode_is_chosen_by_argument_then_environment() -> None:
    assert netns.requested_mode(None, {}) == "auto"
    assert netns.requested_mode(None, {netns.ENV_NETWORK: "namespaces"}) == "namespaces"
    assert netns.requested_mode("loopback", {netns.ENV_NETWORK: "namespaces"}) == "loopback"
    with pytest.raises(netns.NetworkError, match="'bridged' is not one of"):
        netns.requested_mode("bridged", {})
    assert netns.host_ports_in({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443/x"}) == {4443}
    assert netns.stale("rr-aaaa-1-p1", "rr-bbbb-", lambda pid: False)
    assert not netns.stale("rr-aaaa-1-p1", "rr-bbbb-", lambda pid: True)
    assert netns.stale("rr-bbbb-1-node", "rr-bbbb-", lambda pid: True)
    assert not netns.stale("other", "rr-bbbb-", lambda pid: False)


def test_the_kubelet_reaches_pods_through_the_node_namespace(cluster: LocalCluster) -> None:
    assert cluster.network is not None
    dial = cluster.network.dialer()
    assert dial is not None
    # The bridge's gateway lives in the node namespace only; a socket the dialer makes
    # reaches it (nothing listens there: refused, not unreachable).
    gateway = str(netns.bridge_network(cluster.pod_network).network_address + 1)
    sock = dial()
    sock.settimeout(2)
    with pytest.raises(ConnectionRefusedError):
        sock.connect((gateway, 9))
    sock.close()


#: Writes one object to gs:// storage at the fake GCS server the environment names.
GS_WRITE = """
import os, sys
from rolloutrun_runtime.storage.base import open_storage
open_storage(sys.argv[1]).write_bytes("from-pod", os.environ["POD_IP"].encode())
print("written", flush=True)
"""


def test_a_pod_uses_gs_storage_at_the_fake_gcs_server_on_the_machines_loopback(
    tmp_path: Path, fake_gcs: Any
) -> None:
    """A host service named in the cluster's environment (STORAGE_EMULATOR_HOST at
    127.0.0.1) is reached from inside a pod's namespace at the same address."""
    from tests.support.storage_params import BUCKET

    uri = f"gs://{BUCKET}/netns-{time.time_ns()}"
    clusters = local_cluster(tmp_path / "c", network="namespaces", extra_env=fake_gcs.env())
    cluster = next(clusters)
    try:
        api = api_client(cluster)
        core: Any = k8s.CoreV1Api(api)
        core.create_namespaced_pod("default", _pod("gs", GS_WRITE, uri))
        assert _finished(core, "gs").strip() == "written"
        ip = core.read_namespaced_pod("gs", "default").status.pod_ip
        api.close()
    finally:
        clusters.close()
    blob = fake_gcs.client().bucket(BUCKET).blob(f"{uri.split('/', 3)[3]}/from-pod")
    assert blob.download_as_bytes() == ip.encode() and ip.startswith("10.")


def _node_ready(core: Any) -> str:
    node = core.read_node("local")
    return {c.type: c.status for c in node.status.conditions}["Ready"]


def test_a_node_partition_turns_the_node_unknown_until_it_heals(
    cluster: LocalCluster, core: Any
) -> None:
    core.create_namespaced_pod("default", _pod("sleeper", "import time; time.sleep(300)"))
    eventually(lambda: _ready(core, "sleeper"), what="sleeper ready")
    done = cluster.partition(node="local", seconds=2)
    assert done.node == "local" and "default/sleeper" in done.pods
    assert _node_ready(core) == "Unknown"
    assert _ready(core, "sleeper") is None
    pids = cluster.pod_pids("default", "sleeper")
    assert pids and all(_proc_state(pid) != "T" for pid in pids)  # cut off, still running
    eventually(lambda: _node_ready(core) == "True", timeout=30, what="the node back")
    eventually(lambda: _ready(core, "sleeper"), what="sleeper ready again")
    core.delete_namespaced_pod("sleeper", "default")


def _proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_in_loopback_mode_a_partition_is_a_freeze(tmp_path: Path) -> None:
    """The weaker stand-in, said so: no link to cut, so the pod's processes stop."""
    clusters = local_cluster(tmp_path / "c", network="loopback")
    cluster = next(clusters)
    try:
        api = api_client(cluster)
        core: Any = k8s.CoreV1Api(api)
        core.create_namespaced_pod("default", _pod("sleeper", "import time; time.sleep(300)"))
        eventually(lambda: _ready(core, "sleeper"), what="sleeper ready")
        pids = cluster.pod_pids("default", "sleeper")
        done = cluster.partition(pod="sleeper", seconds=1)
        assert done.mode == "freeze" and all(_proc_state(pid) == "T" for pid in pids)
        eventually(lambda: all(_proc_state(pid) != "T" for pid in pids), timeout=30, what="thawed")
        api.close()
    finally:
        clusters.close()

"""The operator's API load at scale, with trainers renewing their Leases, printed as JSON.

One operator process (``rolloutrun operator``, under the chart's rights) and N RolloutRuns
on the local cluster. Their pods are bound to a *hollow* node no process kubelet runs:
this benchmark's hollow kubelet (as Kubernetes' kubemark does) marks them Running and
Ready through the API and, for a deleted pod, writes its terminal status and finishes its
deletion, in a process of its own; a load generator (in another process, so neither starves
the API server nor queues the kubelet's writes behind a thousand renewals) acts as each
run's trainer: it takes the run's Lease when its trainer pod runs and renews it every
``duration/3`` seconds through the API, recording a new train step with each renewal and
a new anchor step every minute at the run's own phase, as trainers do. Measured, at the
API server (which counts admitted requests per user):

- ``api_requests_per_run_per_minute``: the operator's requests in steady state (all runs
  Ready and renewing), over ``--window`` seconds. Goal: ≤ 2.
- ``pod_lost_to_replacement_s``: a running trainer pod is lost (deleted at once); the time
  until the API server commits the run's next incarnation's first pod, with its phases
  (``phases_s``: the old Gym pods marked for deletion by the operator, gone, the new pod),
  read from the cluster's store as it commits (no polling requests), and its parts
  (``parts_s``: the benchmark's delete, the operator's two reactions and their sum
  ``operator``, the hollow kubelet's end of the old Gyms, ``end_to_end``). Goal: p99 ≤ 2 s,
  over ``--losses`` (default 100: fewer make p99 the max) one at a time; p50/p90/p99/max,
  and p99 by nearest rank (``p99_nearest_rank``: at 100 losses the bench's p99 is the max).
- ``operator_rss_mib``: the operator's RSS once steady, and its peak.

``baseline``: the same measurement, on fewer runs, with the operator of ``--baseline-ref``
(default: the commit before label-selected watches and Lease-driven passes), run from a
``git archive`` of that commit, or of the checkout ``--baseline-tree`` (this one: an A/A
run), each column on a local cluster of its own, in a process of its own. The columns run
in both orders (``--order ABBA``: the column run second measured slower than the same code
run first); each column reports ``by_order`` (``baseline_first``/``load_first``) and
``combined`` (losses pooled, steady figures at their worst). Usage:
``python -m bench.operator_scale [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import hollow_load
from bench.hollow_load import HOLLOW, hollow_main, hollow_run, note, set_lease_seconds
from bench.operator_recovery import (
    api_cpu_seconds,
    cpu_seconds,
    exists,
    micro_now,
    rss_kib,
    wait,
    with_parent,
)
from bench.scale_columns import combine, goals, loss_parts, loss_summary, sequence
from rolloutrun_localcluster import LocalCluster
from rolloutrun_localcluster.kubelet import free_pod_network
from rolloutrun_localcluster.operator_access import ACCOUNT, NAMESPACE, operator_kubeconfig
from rolloutrun_localcluster.testing import api_client
from rolloutrun_operator.kube import permission_rules

OPERATOR = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
BASELINE_REF = "f9d7b81"
REPO = Path(__file__).resolve().parent.parent


def start_hollow(cluster: LocalCluster, namespace: str) -> list[Any]:
    """The hollow kubelet and the trainers, each in a process of its own (the kubelet's
    pod writes queued seconds behind the renewals when they shared one)."""
    command = [sys.executable, "-m", "bench.operator_scale", "--hollow", namespace]
    kubeconfig = ["--kubeconfig", str(cluster.kubeconfig_path)]
    return [
        subprocess.Popen([*command, "--hollow-role", role, *kubeconfig], preexec_fn=with_parent)
        for role in hollow_load.ROLES
    ]


def renewals(cluster: LocalCluster) -> int:
    """The trainers' Lease patches so far (the API server counts them, per user)."""
    server = cluster.server
    assert server is not None
    return sum(
        count
        for (user, verb, resource), count in list(server.requests.items())
        if user != OPERATOR and verb == "patch" and resource == "leases"
    )


class Commits:
    """When (monotonic) the API server committed each pod write of ``namespace`` that a loss
    sample needs: a listener on the cluster's store, so measuring adds no request and no
    polling delay. Keys: ``(what, pod)``, what in ``added``, ``deleting``, ``deleted``."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.namespace = namespace
        self.at: dict[tuple[str, str], float] = {}
        cluster.store.subscribe(self._saw)

    def _saw(self, event: Any) -> None:
        meta = event.obj.get("metadata") or {}
        if event.storage_key != "pods" or meta.get("namespace") != self.namespace:
            return
        name = str(meta.get("name"))
        if event.type == "ADDED":
            self.at.setdefault(("added", name), time.monotonic())
        elif event.type == "DELETED":
            self.at.setdefault(("deleted", name), time.monotonic())
        elif meta.get("deletionTimestamp"):
            self.at.setdefault(("deleting", name), time.monotonic())


# ------------------------------------------------------------------ the operator
def start_operator(cluster: LocalCluster, namespace: str, tree: Path | None) -> Any:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}/operator:{tree}/runtime:{tree}"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rolloutrun_runtime.cli",
            "operator",
            "--kubeconfig",
            str(operator_kubeconfig(cluster, permission_rules())),
            "-n",
            namespace,
            "--metrics-port",
            "0",
        ],
        preexec_fn=with_parent,
        stdout=subprocess.DEVNULL,
        stderr=open(os.environ.get("BENCH_OPERATOR_LOG", os.devnull), "ab"),
        env=env,
    )


def operator_requests(cluster: LocalCluster) -> dict[str, int]:
    server = cluster.server
    assert server is not None
    counts: dict[str, int] = {}
    for (user, verb, resource), count in list(server.requests.items()):
        if user == OPERATOR and resource != "events":
            key = f"{verb} {resource}"
            counts[key] = counts.get(key, 0) + count
    return counts


class ServerStalls:
    """The API server's event loop (in this process) answering late: a thread asks it to run
    nothing every ``period`` and keeps each wait over ``threshold`` with its wall time, so a
    Lease-expiry storm can be told apart from a stall of the server itself (the operator's
    log, ``BENCH_OPERATOR_LOG``, times its own reads)."""

    def __init__(self, cluster: LocalCluster, period: float = 0.25, threshold: float = 0.2):
        self.cluster, self.period, self.threshold = cluster, period, threshold
        self.seen: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._probe, name="server-stalls", daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        while not self.stop.wait(self.period):
            asked, wall = time.monotonic(), time.time()
            try:
                self.cluster.call(lambda: None)
            except RuntimeError:  # the cluster stopped
                return
            waited = time.monotonic() - asked
            if waited > self.threshold:
                self.seen.append((wall, waited))

    def report(self) -> dict[str, Any]:
        self.stop.set()
        worst = sorted(self.seen, key=lambda seen: -seen[1])[:10]
        return {
            "over_s": self.threshold,
            "count": len(self.seen),
            "worst": [
                {"at_utc": time.strftime("%H:%M:%S", time.gmtime(at)), "s": round(waited, 3)}
                for at, waited in worst
            ],
        }


def measure(
    cluster: LocalCluster,
    api: Any,
    namespace: str,
    runs: int,
    window: float,
    losses: int,
    tree: Path | None,
    gap: float = 1.0,
) -> dict[str, Any]:
    from kubernetes import client as k8s

    from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION

    core: Any = k8s.CoreV1Api(api)
    objects: Any = k8s.CustomObjectsApi(api)
    core.create_namespace({"metadata": {"name": namespace}})
    commits = Commits(cluster, namespace)
    stalls = ServerStalls(cluster)
    hollow = start_hollow(cluster, namespace)
    operator = start_operator(cluster, namespace, tree)
    try:
        names = [f"r{index:04d}" for index in range(runs)]
        t0 = time.monotonic()
        for name in names:
            objects.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, hollow_run(name)
            )

        rtype = cluster.registry.get(GROUP, VERSION, PLURAL)
        assert rtype is not None

        def all_held() -> bool:
            # Read from the store, in process: listing a thousand runs through the API every
            # two seconds cost the API server (and this process's lock) a tenth of its time.
            held = 0
            for item in cluster.store.objects(rtype.storage_key):
                if item["metadata"].get("namespace") != namespace:
                    continue
                status = item.get("status") or {}
                lease = (status.get("lease") or {}).get("holder", "")
                if lease.endswith(f"/{status.get('incarnation')}"):
                    held += 1
            note(f"{namespace}: {held}/{runs} runs hold their Lease")
            return held == runs

        deadline = time.monotonic() + 1800
        while not all_held():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{runs} runs running and renewing")
            time.sleep(2.0)
        note(f"{namespace}: {runs} runs renewing after {time.monotonic() - t0:.0f} s")
        converged = time.monotonic() - t0
        time.sleep(min(20.0, window / 4))  # the last passes done
        before, renewals0 = operator_requests(cluster), renewals(cluster)
        w0, cpu0, api0 = time.monotonic(), cpu_seconds(operator.pid), api_cpu_seconds(cluster)
        time.sleep(window)
        after, elapsed = operator_requests(cluster), time.monotonic() - w0
        cpu = cpu_seconds(operator.pid) - cpu0
        api_cpu = api_cpu_seconds(cluster) - api0
        renewed = renewals(cluster) - renewals0
        made = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        made = {k: v for k, v in made.items() if v}
        total = sum(made.values())
        rss = rss_kib(operator.pid)
        items = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
        restarts = sum(int((i.get("status") or {}).get("restarts") or 0) for i in items)
        note(f"{namespace}: {sum(made.values())} operator requests in {elapsed:.0f} s")
        pass_cost = one_pass_cost(cluster, objects, namespace, names[-1], total / elapsed)
        victims = [names[index % runs] for index in range(losses)]
        reaction = lost_pods(core, objects, commits, namespace, victims, gap)
    finally:
        server_stalls = stalls.report()
        operator.send_signal(signal.SIGTERM)
        operator.wait(60)
        for process in hollow:
            process.send_signal(signal.SIGTERM)
        for process in hollow:
            process.wait(60)
    per_run_min = total / runs / (elapsed / 60)
    resync = resync_seconds(tree)
    return {
        "runs": runs,
        "lease_duration_s": hollow_load.LEASE_DURATION_S,
        "converged_s": round(converged, 1),
        "window_s": round(elapsed, 1),
        "lease_renewals_per_run_per_minute": round(renewed / runs / (elapsed / 60), 2),
        "api_requests_per_run_per_minute": round(per_run_min, 3),
        "api_requests_by_verb": made,
        "operator_cpu_share_steady": round(cpu / elapsed, 3),
        "api_server_cpu_share_steady": round(api_cpu / elapsed, 3),
        "pass_cost_requests": pass_cost,
        "restarts_before_losses": restarts,
        "resync_s": resync,
        "api_requests_per_run_per_minute_with_resync": round(
            per_run_min + (pass_cost * 60 / resync if resync and window < resync else 0), 3
        ),
        "pod_lost_to_replacement_s": reaction,
        "api_server_stalls": server_stalls,
        "operator_rss_mib": {
            "steady": round(rss["VmRSS"] / 1024, 1),
            "peak": round(rss["VmHWM"] / 1024, 1),
        },
    }


#: How long ``one_pass_cost`` counts after its poke (a steady pass takes milliseconds).
POKED_PASS_S = 5.0


def one_pass_cost(
    cluster: LocalCluster, objects: Any, namespace: str, run: str, steady_per_s: float
) -> int:
    """The operator's requests for one pass of a steady run, woken by an annotation: those
    counted in the seconds after the poke, less what the other runs' steady state makes in
    as long (at 1,000 runs ~80 requests in 5 s, where a pass is about 5)."""
    from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION

    before = sum(operator_requests(cluster).values())
    patch = {"metadata": {"annotations": {"bench/poke": micro_now()}}}
    objects.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, run, patch)
    time.sleep(POKED_PASS_S)
    counted = sum(operator_requests(cluster).values()) - before
    return pass_requests(counted, steady_per_s, POKED_PASS_S)


def pass_requests(counted: int, steady_per_s: float, seconds: float) -> int:
    """One pass's requests out of ``counted`` over ``seconds``, the steady rate taken off."""
    return max(0, round(counted - steady_per_s * seconds))


def resync_seconds(tree: Path | None) -> float | None:
    """The operator's longest wait without an event (its resync), from its source."""
    source = (tree or REPO) / "operator" / "rolloutrun_operator" / "handlers.py"
    for line in source.read_text().splitlines():
        if line.startswith("MAX_IDLE_SECONDS"):
            return float(line.split("=")[1].strip())
    return None


def lost_pods(
    core: Any, objects: Any, commits: Commits, namespace: str, victims: list[str], gap: float
) -> dict[str, Any]:
    """Lose each victim's running trainer, one at a time (``gap`` seconds after the last
    one's replacement: one loss under way at a time, the others steady), and time the
    replacement from the API server's commits (:class:`Commits`), split into its phases
    (:func:`phases`) and into whose part each stretch is (``parts``: the operator's two
    reactions, the hollow kubelet's, end to end; :func:`bench.scale_columns.loss_parts`)."""
    from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION

    skipped, missing, each = 0, [], []  # each loss, with its wall-clock time (the log's)
    for run in victims:
        status = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, run)
        n = int((status.get("status") or {}).get("incarnation") or 0)
        if not exists(core, namespace, f"{run}-i{n}-trainer"):
            skipped += 1  # between incarnations: not a running trainer to lose
            continue
        t0, lost_at = time.monotonic(), time.time()
        core.delete_namespaced_pod(f"{run}-i{n}-trainer", namespace, grace_period_seconds=0)
        replacement = ("added", f"{run}-i{n + 1}-gym-0")
        try:
            wait(lambda key=replacement: key in commits.at, replacement[1], bound=120)
        except TimeoutError:
            missing.append(f"{run}-i{n}")  # reported, and the other samples kept
        marks = phases(commits.at, run, n, t0)
        sample = {"run": run, "lost_at": round(lost_at, 3), **marks}
        each.append({**sample, "second_of_minute": round(lost_at % 60, 1)})
        each[-1]["parts"] = loss_parts(marks)
        time.sleep(gap)  # the next incarnation's pods started before the next loss
    return {
        **loss_summary(each),
        "skipped": skipped,
        "missing_after_120s": missing,
        "goal_p99_s": 2.0,
        "samples": each,
    }


def phases(at: dict[tuple[str, str], float], run: str, n: int, t0: float) -> dict[str, float]:
    """Seconds from ``t0`` (the trainer's deletion sent) until the API server committed:
    the trainer gone (``trainer_gone``), every old Gym pod marked for deletion by the
    operator (``gyms_deleting``: its first reaction), the hollow kubelet's end of them
    (``gyms_gone``), and the next incarnation's first pod (``replacement``: the operator's
    second reaction)."""
    gyms = [f"{run}-i{n}-gym-{index}" for index in range(2)]
    marks = {
        "trainer_gone": [at.get(("deleted", f"{run}-i{n}-trainer"))],
        "gyms_deleting": [at.get(("deleting", gym), at.get(("deleted", gym))) for gym in gyms],
        "gyms_gone": [at.get(("deleted", gym)) for gym in gyms],
        "replacement": [at.get(("added", f"{run}-i{n + 1}-gym-0"))],
    }
    return {
        phase: round(max(times) - t0, 3)
        for phase, times in marks.items()
        if all(t is not None for t in times)  # type: ignore[type-var]
    }


def archive(ref: str, into: Path) -> Path:
    into.mkdir(parents=True)
    tar = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "operator", "runtime"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def half(
    where: Path,
    namespace: str,
    runs: int,
    window: float,
    losses: int,
    tree: Path | None,
    gap: float,
) -> dict[str, Any]:
    """One column of the comparison, on a local cluster of its own: the second column run
    on the first one's cluster met its thousand runs' objects still there (an A/A run gave
    0.195 s against 0.777 s p99), so each column starts from an empty cluster."""
    with LocalCluster(where, pod_network=free_pod_network(), pace_gc=True) as cluster:
        from kubernetes import client as k8s

        from rolloutrun_operator.api.crdgen import build_crd

        api = api_client(cluster)
        try:
            k8s.ApiextensionsV1Api(api).create_custom_resource_definition(build_crd())
            node = {
                "metadata": {"name": HOLLOW, "labels": {"bench": HOLLOW}},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            }
            k8s.CoreV1Api(api).create_node(node)
            k8s.CoreV1Api(api).patch_node_status(HOLLOW, {"status": node["status"]})
            return measure(cluster, api, namespace, runs, window, losses, tree, gap)
        finally:
            api.close()


def half_in_process(
    namespace: str,
    runs: int,
    window: float,
    losses: int,
    tree: Path | None,
    gap: float,
    lease_seconds: int,
) -> dict[str, Any]:
    """:func:`half` in a fresh interpreter: the local cluster's API server runs in the
    benchmark's process, and an A/A run of two halves in one process still measured the
    second slower (the API server's own commit of the loss 7x slower) on a fresh cluster."""
    command = [sys.executable, "-m", "bench.operator_scale", "--one-half", namespace]
    command += ["--runs", str(runs), "--window", str(window), "--losses", str(losses)]
    command += ["--loss-gap", str(gap), "--lease-seconds", str(lease_seconds)]
    command += ["--baseline-tree", str(tree)] if tree is not None else []
    answer = subprocess.run(command, check=True, stdout=subprocess.PIPE).stdout
    return dict(json.loads(answer))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--window", type=float, default=600.0, help="steady-state seconds")
    parser.add_argument(
        "--losses", type=int, default=100, help="trainer pods lost (runs taken in turn)"
    )
    parser.add_argument(
        "--loss-gap", type=float, default=1.0, help="seconds from a replacement to the next loss"
    )
    parser.add_argument("--baseline-runs", type=int, default=50)
    parser.add_argument("--baseline-window", type=float, default=120.0)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="the baseline's operator from this checkout (its operator/ and runtime/), not "
        "--baseline-ref; this checkout itself gives an A/A run",
    )
    parser.add_argument("--baseline-losses", type=int, default=20)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--order",
        default="ABBA",
        help="the columns' halves in turn, A the baseline and B this tree, in pairs: ABBA "
        "runs each column once first and once second (the column run second measured "
        "slower); AB halves the time",
    )
    parser.add_argument("--quick", action="store_true", help="50 runs, 60 s windows")
    parser.add_argument(
        "--lease-seconds",
        type=int,
        default=hollow_load.LEASE_DURATION_S,
        help="the runs' leaseDurationSeconds (trainers renew every third of it); a loaded "
        "machine whose API server cannot keep up with the renewals expires Leases instead",
    )
    parser.add_argument("--hollow", metavar="NAMESPACE", help=argparse.SUPPRESS)
    parser.add_argument("--hollow-role", choices=sorted(hollow_load.ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--one-half", metavar="NAMESPACE", help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    parser.set_defaults(
        lease_seconds=int(os.environ.get("BENCH_LEASE_SECONDS", hollow_load.LEASE_DURATION_S))
    )
    args = parser.parse_args()
    set_lease_seconds(args.lease_seconds)
    if args.hollow:
        return hollow_main(args.kubeconfig, args.hollow, args.hollow_role)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the clusters and operator end
    if args.one_half:
        with tempfile.TemporaryDirectory(prefix="rolloutrun-scale-") as tmp:
            tree = args.baseline_tree.resolve() if args.baseline_tree is not None else None
            found = half(
                Path(tmp) / "cluster",
                args.one_half,
                args.runs,
                args.window,
                args.losses,
                tree,
                args.loss_gap,
            )
        print(json.dumps(found))
        return 0
    if args.quick:
        args.runs, args.window, args.losses, args.baseline_losses = 50, 60.0, 5, 5
        args.baseline_runs, args.baseline_window = 20, 60.0
    if args.no_baseline:
        args.order = "B"
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()}}
    halves: dict[str, list[dict[str, Any]]] = {"baseline": [], "load": []}
    with tempfile.TemporaryDirectory(prefix="rolloutrun-scale-") as tmp:
        work = Path(tmp)
        tree, ref = None, None
        if not args.no_baseline:
            if args.baseline_tree is not None:
                tree, ref = args.baseline_tree.resolve(), str(args.baseline_tree)
            else:
                tree, ref = archive(args.baseline_ref, work / "baseline"), args.baseline_ref
        plan = [("load", "load_only")] if args.no_baseline else sequence(args.order)
        report["order"] = {"asked": args.order, "halves": [f"{c} ({o})" for c, o in plan]}
        for column, order in plan:
            began, load_before = time.monotonic(), os.getloadavg()
            if column == "baseline":
                found = half_in_process(
                    "baseline",
                    args.baseline_runs,
                    args.baseline_window,
                    args.baseline_losses,
                    tree,
                    args.loss_gap,
                    args.lease_seconds,
                )
            else:
                found = half_in_process(
                    "load",
                    args.runs,
                    args.window,
                    args.losses,
                    None,
                    args.loss_gap,
                    args.lease_seconds,
                )
            note(f"{column} ({order}): p99 {found['pod_lost_to_replacement_s'].get('p99')} s")
            found["seconds"] = round(time.monotonic() - began, 1)
            found["load_before"], found["load_after"] = load_before, os.getloadavg()
            halves[column].append({"order": order, **found})
    report["machine"]["load_at_end"] = os.getloadavg()
    for column, measured in halves.items():
        if measured:
            extra = {"ref": ref} if column == "baseline" else {}
            report[column] = {**extra, **combine(measured)}
    report["goals"] = goals(report["load"]["combined"])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

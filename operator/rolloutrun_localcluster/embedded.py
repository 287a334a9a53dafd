"""The embedded default: ``rolloutrun run FILE`` runs a RolloutRun end to end on one machine.

Why through a local cluster rather than a shortcut: the point of the project is that a run
survives its pods being taken away, and the only honest way to show that locally is the
same path a real cluster takes. So this starts the local cluster (API server emulator +
process kubelet), the operator (the same Kopf handlers, in a thread), and the RolloutRun;
the trainer and the Gym replicas run as pods (``rolloutrun trainer``, ``rolloutrun gym``
processes). ``--preempt-every`` deletes a random member pod at that interval, as a spot
reclaim does, and the operator recovers the run from its latest snapshot.

Like the operator, this package reaches the runtime only through its contract, so the
audit and the trace analysis are read through their commands (``rolloutrun audit --json``,
``rolloutrun trace --json``) as subprocesses. :class:`EmbeddedRun` is also what the
end-to-end tests and ``bench/operator_recovery.py`` drive; the command around it (arguments,
display, summary line) is :mod:`.run_command`.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from rolloutrun_operator import naming
from rolloutrun_operator.api.crdgen import build_crd
from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from rolloutrun_operator.handlers import Options
from rolloutrun_operator.kube import permission_rules
from rolloutrun_operator.naming import Role
from rolloutrun_operator.runner import OperatorConfig, OperatorThread
from rolloutrun_runtime.contract.kube_yaml import load_yaml
from rolloutrun_runtime.contract.layout import GYM_AUDIT_PREFIX

from . import storage_provisioner
from .cluster import LocalCluster
from .kubelet import free_pod_network
from .operator_access import operator_kubeconfig

logger = logging.getLogger(__name__)

#: Under the work directory: the run's storage (checkpoints, manifests, Gym audit files),
#: the trainer's log dir shared by every incarnation, and the local cluster's files.
STORAGE_DIR = "storage"
LOGS_DIR = "logs"
CLUSTER_DIR = "cluster"
SUMMARY_FILE = "summary.json"
RUN_FILE = "rolloutrun.yaml"
#: Seconds to wait, once the run ended, for the status to mirror the trainer's last progress.
SETTLE_S = 10.0
#: Seconds an audit or trace command may take.
COMMAND_TIMEOUT_S = 300.0


class EmbeddedRunError(RuntimeError):
    """The run could not be started or followed (bad file, cluster or operator failure)."""


def load_document(path: str | Path) -> dict[str, Any]:
    """A RolloutRun YAML as a mapping; errors name the file and the problem."""
    path = Path(path)
    try:
        document = load_yaml(path.read_text())
    except FileNotFoundError as error:
        raise EmbeddedRunError(f"{path}: no such file") from error
    except yaml.YAMLError as error:
        raise EmbeddedRunError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(document, dict) or document.get("kind") != "RolloutRun":
        raise EmbeddedRunError(f"{path}: expected a RolloutRun (kind: RolloutRun)")
    if not (document.get("metadata") or {}).get("name"):
        raise EmbeddedRunError(f"{path}: metadata.name is required")
    return document


def api_message(error: Any) -> str:
    """An ``ApiException``'s Status message (its reason and code without one)."""
    try:
        status = json.loads(error.body or "")
    except (TypeError, ValueError):
        status = None
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return f"{error.status} {error.reason}"


def localize(document: dict[str, Any], work_dir: Path, namespace: str) -> dict[str, Any]:
    """The run as the local cluster runs it: storage and logs on a claim in ``work_dir``.

    As on a real cluster, the storage is a claim (``<run>-storage``, bound to a volume on
    ``work_dir/storage``, see :func:`.storage_provisioner.static_claim`) mounted at that
    same path in the trainer and Gym pods. The trainer of every incarnation appends to one
    log dir on it (``storage/logs``, linked at ``work_dir/logs``), so the metrics and the
    rollout trace cover the whole run.
    """
    run = copy.deepcopy(document)
    name = run["metadata"]["name"]
    kept = {k: v for k, v in run["metadata"].items() if k in ("labels", "annotations") and v}
    run["metadata"] = {"name": name, "namespace": namespace, **kept}  # labels: a Kueue queue
    spec = run.setdefault("spec", {})
    work_dir = work_dir.resolve()
    spec["storage"] = {
        "uri": f"file://{work_dir / STORAGE_DIR}",
        "volumeClaimName": storage_provisioner.run_claim_name(name),
    }
    spec.setdefault("run", {})["logDir"] = str(work_dir / STORAGE_DIR / LOGS_DIR)
    run.pop("status", None)
    return run


def condition_of(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for item in status.get("conditions") or []:
        if item.get("type") == kind:
            return dict(item)
    return None


def outcome(status: dict[str, Any]) -> str | None:
    """``Succeeded``, ``Failed``, or None while the run goes on."""
    for kind in ("Succeeded", "Failed"):
        found = condition_of(status, kind)
        if found is not None and found.get("status") == "True":
            return kind
    return None


def last_step(metrics_file: Path) -> dict[str, Any] | None:
    """The newest complete step line of ``metrics.jsonl`` (None before the first step)."""
    try:
        lines = metrics_file.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if isinstance(record, dict):
            return record
    return None


def run_json_command(args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
    """Run ``rolloutrun <args>`` and parse its JSON output; failures become an ``error`` key."""
    command = [sys.executable, "-m", "rolloutrun_runtime.cli", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"rolloutrun {' '.join(args)} ran past {timeout:.0f}s"}
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"rolloutrun {args[0]} exited {done.returncode}: {' | '.join(tail)}"}
    if not isinstance(answer, dict):
        return {"error": f"rolloutrun {args[0]} printed no JSON object"}
    answer.setdefault("exit_code", done.returncode)
    return answer


def audit_holds(audit: dict[str, Any]) -> bool:
    """Whether ``rolloutrun audit --json`` reported every invariant holding."""
    if "error" in audit:
        return False
    for key in ("ok", "holds", "passed", "clean"):
        if key in audit:
            return bool(audit[key]) and audit.get("exit_code", 0) == 0
    return False


@dataclass
class Preemptions:
    """Deleted member pods, as spot reclaims: ``(time since start, pod name)``."""

    done: list[tuple[float, str]] = field(default_factory=list)
    uids: set[str] = field(default_factory=set)
    """The deleted pods' uids: a replaced member keeps its name, not its uid."""


@dataclass
class TrainingClock:
    """Whether the current incarnation trains, for ``--preempt-while-training``.

    Why: an incarnation takes seconds to start (pods, interpreters, torch, restore), so a
    fixed interval shorter than that deletes pods that never trained and proves nothing
    about recovery. An incarnation trains once its trainer holds the Lease and has moved
    the Lease's train-step annotation off the value it first wrote there.
    """

    holder: str | None = None
    first_step: str | None = None
    training: bool = False

    def observe(self, holder: str | None, step: str | None) -> bool:
        """Feed the current incarnation's Lease holder (None if another holds it) and step."""
        if holder != self.holder:
            self.holder, self.first_step, self.training = holder, step, False
        elif holder is not None and step != self.first_step:
            self.training = True
        return self.training


def serving_uids(
    pods: dict[str, Any], incarnation: str, roles: Collection[str] | None = None
) -> dict[str, str]:
    """Name -> uid of ``pods`` that serve ``incarnation`` (of ``roles``): running, not
    terminating, while its trainer is such a pod (see :meth:`EmbeddedRun.serving_members`)."""
    serving = {
        name: pod
        for name, pod in pods.items()
        if _label(pod, naming.LABEL_INCARNATION) == incarnation
        and pod.metadata.deletion_timestamp is None
        and pod.status.phase == "Running"
    }
    if not any(_label(pod, naming.LABEL_ROLE) == Role.TRAINER.value for pod in serving.values()):
        return {}
    return {
        name: str(pod.metadata.uid)
        for name, pod in serving.items()
        if roles is None or _label(pod, naming.LABEL_ROLE) in roles
    }


def _label(pod: Any, key: str) -> str | None:
    return (pod.metadata.labels or {}).get(key)


class EmbeddedRun:
    """A local cluster, the operator and one RolloutRun; a context manager.

    ``work_dir`` holds everything: ``cluster/`` (pod directories with their logs),
    ``storage/`` (checkpoints, manifests, ``gym-audit/``) and ``logs/`` (metrics, trace,
    final weights digest).
    """

    def __init__(
        self,
        document: dict[str, Any],
        work_dir: str | Path,
        *,
        namespace: str = "default",
        nodes: int = 1,
        cluster_options: dict[str, Any] | None = None,
        crds: list[dict[str, Any]] | None = None,
    ) -> None:
        self.work_dir = Path(work_dir).resolve()
        self.namespace = namespace
        self.document = localize(document, self.work_dir, namespace)
        self.name: str = self.document["metadata"]["name"]
        self.nodes = nodes
        self.cluster_options = dict(cluster_options or {})
        # A random loopback /16: runs and test sessions side by side never share a pod IP.
        self.cluster_options.setdefault("pod_network", free_pod_network())
        self.cluster: LocalCluster | None = None
        self.operator: OperatorThread | None = None
        self.api: Any = None
        self.started_at = time.monotonic()
        self.isolation: str | None = None  # the cluster's pod isolation, once started
        self.crds = list(crds or [])
        """More CRDs, installed before the operator starts (a test's emulated Kueue)."""

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> EmbeddedRun:
        from kubernetes import client as k8s
        from kubernetes import config

        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(yaml.safe_dump(self.document, sort_keys=False))
        self.cluster = LocalCluster(
            self.work_dir / CLUSTER_DIR, nodes=self.nodes, **self.cluster_options
        ).start()
        self.isolation = self.cluster.isolation
        try:
            self.api = config.new_client_from_config(config_file=str(self.cluster.kubeconfig_path))
            crds: Any = k8s.ApiextensionsV1Api(self.api)
            crds.create_custom_resource_definition(build_crd())
            for crd in self.crds:
                crds.create_custom_resource_definition(crd)
            if self.namespace != "default":
                self.core.create_namespace({"metadata": {"name": self.namespace}})
            self._claim_storage()
            # The operator runs as its own account under the chart's rules, not as admin.
            operator = operator_kubeconfig(self.cluster, permission_rules())
            options = Options(kubeconfig=str(operator))
            self.operator = OperatorThread(
                OperatorConfig(options=options, namespaces=[self.namespace])
            ).start()
            self.started_at = time.monotonic()
            self._create_run()
        except BaseException:
            self.stop()
            raise
        return self

    def _create_run(self) -> None:
        """The RolloutRun itself; a refusal is an :class:`EmbeddedRunError` with the API
        server's own message (what ``kubectl apply`` would print), not a client traceback."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.runs.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.document
            )
        except ApiException as error:
            raise EmbeddedRunError(
                f"the API server refused the run: {api_message(error)}"
            ) from None

    def _claim_storage(self) -> None:
        """The run's storage claim, bound to a volume on ``storage/`` (``logs`` linked)."""
        self.storage_dir.mkdir(exist_ok=True)
        (self.storage_dir / LOGS_DIR).mkdir(exist_ok=True)
        link = self.work_dir / LOGS_DIR
        if not link.exists() and not link.is_symlink():
            link.symlink_to(Path(STORAGE_DIR) / LOGS_DIR)
        pv, claim = storage_provisioner.static_claim(self.name, self.namespace, self.storage_dir)
        self.core.create_persistent_volume(pv)
        self.core.create_namespaced_persistent_volume_claim(self.namespace, claim)

    def stop(self) -> None:
        """Stop the operator, then the cluster (which kills every pod process)."""
        if self.operator is not None:
            self.operator.stop()
            self.operator = None
        if self.api is not None:
            self.api.close()
            self.api = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def __enter__(self) -> EmbeddedRun:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ reading
    @property
    def runs(self) -> Any:
        from kubernetes import client as k8s

        return k8s.CustomObjectsApi(self.api)

    @property
    def core(self) -> Any:
        from kubernetes import client as k8s

        return k8s.CoreV1Api(self.api)

    @property
    def storage_dir(self) -> Path:
        return self.work_dir / STORAGE_DIR

    @property
    def config_file(self) -> Path:
        """The run as created (written at start; the audit reads its seed and max steps)."""
        return self.work_dir / RUN_FILE

    @property
    def log_dir(self) -> Path:
        return self.storage_dir / LOGS_DIR

    def elapsed(self) -> float:
        return time.monotonic() - self.started_at

    def status(self) -> dict[str, Any]:
        run = self.runs.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        return dict(run.get("status") or {})

    def pods(self) -> dict[str, Any]:
        """The run's member pods by name (every incarnation still present)."""
        selector = f"{naming.LABEL_RUN}={self.name}"
        items = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return {pod.metadata.name: pod for pod in items}

    def serving_members(self, roles: Collection[str] | None = None) -> list[str]:
        """Running, not terminating pods of the current incarnation (of ``roles``), while
        its trainer is one: an incarnation whose trainer is gone is ending, and a deletion
        of its other pods would preempt nothing (yet count against ``--max-preemptions``)."""
        return sorted(self.serving_member_uids(roles))

    def serving_member_uids(self, roles: Collection[str] | None = None) -> dict[str, str]:
        """Name -> uid of :meth:`serving_members` (a replaced member keeps its name)."""
        incarnation = str(self.status().get("incarnation") or "")
        return serving_uids(self.pods(), incarnation, roles)

    def lease(self) -> Any:
        """The trainer's Lease (None before the operator created it)."""
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException

        try:
            return k8s.CoordinationV1Api(self.api).read_namespaced_lease(
                naming.lease_name(self.name), self.namespace
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def lease_holder(self) -> str | None:
        lease = self.lease()
        return None if lease is None else lease.spec.holder_identity

    def last_step(self) -> dict[str, Any] | None:
        return last_step(self.log_dir / "metrics.jsonl")

    # ------------------------------------------------------------------ acting
    def delete_pod(self, name: str, grace_seconds: int | None = None) -> None:
        """Delete a member pod as a spot reclaim does (SIGTERM, then SIGKILL after grace)."""
        body = {} if grace_seconds is None else {"gracePeriodSeconds": grace_seconds}
        self.core.delete_namespaced_pod(name, self.namespace, body=body)

    def pod_pids(self, name: str) -> set[int]:
        assert self.cluster is not None
        return self.cluster.pod_pids(self.namespace, name)

    # ------------------------------------------------------------------ following
    def follow(
        self,
        *,
        preempt_every: float | None = None,
        max_preemptions: int | None = None,
        while_training: bool = False,
        timeout: float | None = None,
        rng: random.Random | None = None,
        on_tick: Callable[[EmbeddedRun, dict[str, Any]], None] | None = None,
        interval: float = 0.5,
        roles: Collection[str] | None = None,
        grace_seconds: int | None = None,
    ) -> tuple[str, Preemptions]:
        """Poll until the run Succeeds or Fails; preempt a random member every so often.

        With ``max_preemptions`` the deletions stop after that many, so a run whose
        incarnations start more slowly than ``preempt_every`` still reaches its end. With
        ``while_training`` the interval counts only while the current incarnation trains
        (:class:`TrainingClock`): each deletion lands ``preempt_every`` seconds into training.
        ``roles`` (e.g. ``{"gym"}``) limits the victims to those members' pods (default: all).
        ``grace_seconds``: the deletions' grace period (0: SIGKILL at once; None: the pod's).
        Returns the outcome (``Succeeded``, ``Failed``, or ``TimedOut``) and the deletions.
        """
        rng = rng or random.Random()
        preempted = Preemptions()
        next_preemption = self.elapsed() + preempt_every if preempt_every else None
        clock = TrainingClock()
        while True:
            status = self.status()
            if on_tick is not None:
                on_tick(self, status)
            result = outcome(status)
            if result is not None:
                self._settle(interval)
                return result, preempted
            if self.operator is not None and not self.operator.alive:
                raise EmbeddedRunError(f"the operator stopped: {self.operator.error!r}")
            now = self.elapsed()
            if timeout is not None and now > timeout:
                return "TimedOut", preempted
            if while_training and next_preemption and not self._training(clock, status):
                next_preemption = now + (preempt_every or 0.0)
            budget_left = max_preemptions is None or len(preempted.done) < max_preemptions
            if next_preemption and preempt_every and budget_left and now >= next_preemption:
                serving = self.serving_member_uids(roles)
                members = sorted(m for m, uid in serving.items() if uid not in preempted.uids)
                if members:
                    victim = rng.choice(members)
                    logger.info("preempting %s", victim)
                    self.delete_pod(victim, grace_seconds)
                    preempted.done.append((round(now, 2), victim))
                    preempted.uids.add(serving[victim])
                    next_preemption = now + preempt_every
            time.sleep(interval)

    def _training(self, clock: TrainingClock, status: dict[str, Any]) -> bool:
        lease = self.lease()
        holder = None if lease is None else lease.spec.holder_identity
        if not (holder or "").endswith(f"/{status.get('incarnation')}"):
            holder = None
        annotations = (lease.metadata.annotations or {}) if lease is not None else {}
        return clock.observe(holder, annotations.get(naming.ANNOTATION_TRAIN_STEP))

    def _settle(self, interval: float, bound: float = SETTLE_S) -> None:
        """Wait (a little) until the status mirrors the Lease's final progress annotations.

        The trainer's last annotations and its exit race in the operator's pass that sees
        the exit; the next pass (the Lease change wakes it) mirrors them."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            lease = self.lease()
            annotations = (lease.metadata.annotations or {}) if lease is not None else {}
            wanted = annotations.get(naming.ANNOTATION_TRAIN_STEP)
            if wanted is None or str(self.status().get("trainStep")) == wanted:
                return
            time.sleep(interval)

    # ------------------------------------------------------------------ summary
    def summary(self, result: str, preempted: Preemptions) -> dict[str, Any]:
        """What the run did, with the audit's and the trace's own JSON."""
        status = self.status() if self.api is not None else {}
        audit = run_json_command(
            [
                "audit",
                str(self.storage_dir / GYM_AUDIT_PREFIX),
                "--storage",
                f"file://{self.storage_dir}",
                "--config",
                str(self.config_file),
                "--json",
            ]
        )
        trace = run_json_command(["trace", str(self.log_dir), "--json"])
        digest_file = self.log_dir / "final_weights.sha256"
        digest = digest_file.read_text().strip() if digest_file.exists() else None
        step = self.last_step()
        return {
            "run": self.name,
            "result": result,
            "succeeded": result == "Succeeded",
            "steps": int(status.get("trainStep") or (step or {}).get("step") or 0),
            "restarts": int(status.get("restarts") or 0),
            "preemptions": int(status.get("preemptions") or 0),
            "incarnations": int(status.get("incarnation") or 0),
            "member_replacements": member_replacements(status),
            "pods_deleted": [name for _, name in preempted.done],
            "audit": audit,
            "audit_holds": audit_holds(audit),
            "thrown_away_s": trace.get("thrown_away_s_total"),
            "trace": trace,
            "final_weights_sha256": digest,
            "final_reward_mean": (step or {}).get("reward_mean"),
            "latest_manifest": status.get("latestManifestUri"),
            "wall_s": round(self.elapsed(), 2),
            "work_dir": str(self.work_dir),
            "isolation": self.isolation,
        }


def member_replacements(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``status.memberReplacements`` by role: how many, and the loss-to-Ready seconds."""
    return {
        str(record.get("role")): {
            "count": int(record.get("count") or 0),
            "last_s": record.get("lastSeconds"),
            "max_s": record.get("maxSeconds"),
            "recent_s": list(record.get("recentSeconds") or []),
        }
        for record in status.get("memberReplacements") or []
    }

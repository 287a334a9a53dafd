"""The chart's values: the schema refuses what would render a broken operator, and each
option (probes, security contexts, extraArgs, metrics port, PDB, ServiceMonitor, the helm
test, NOTES.txt) renders what it promises. The helm test's check runs here for real, against
the operator's own metrics server on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.chart.test_chart import CHART, VARIANTS, container, helm, render, the

__all__ = ["helm"]  # the fixture, shared with test_chart


def template(helm: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` with ``--set`` before each value (an option passes as it is)."""
    args = [str(helm), "template", "rr", str(CHART), "--namespace", "ops"]
    for value in sets:
        args += [value] if value.startswith("--") else ["--set", value]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("metrics.port=abc", "at '/metrics/port': got string, want integer"),
        ("healthPort=70000", "at '/healthPort': maximum"),
        ("peering.replicas=0", "at '/peering/replicas': minimum"),
        ("peering.enabled=yes", "at '/peering/enabled': got string, want boolean"),
        ("logLevel=TRACE", "at '/logLevel': value must be one of"),
        ("watchNamespaces={Team_A}", "at '/watchNamespaces/0'"),
        ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
        ("extraArgs=--verbose", "at '/extraArgs': got string, want array"),
        ("podSecurityContext=root", "at '/podSecurityContext': got string, want object"),
        ("metrics.serviceMonitor.interval=often", "at '/metrics/serviceMonitor/interval'"),
        ("watchNamespace={team-a}", "additional properties 'watchNamespace' not allowed"),
    ],
)
def test_the_schema_refuses_wrong_values(helm, value, message):
    done = template(helm, value)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr


def test_lint_strict_checks_values_against_the_schema(helm):
    ok = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), "--set", "metrics.port=abc"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "want integer" in bad.stdout + bad.stderr


def test_readiness_and_liveness_probe_kopfs_health_endpoint(helm):
    operator = container(render(helm, "healthPort=8181"))
    ports = {p["name"]: p["containerPort"] for p in operator["ports"]}
    assert ports["health"] == 8181
    assert "--liveness=http://0.0.0.0:8181/healthz" in operator["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert operator[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_security_contexts_are_restricted_by_default_and_overridable(helm):
    docs = render(helm)
    pod = the(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container(docs)["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    custom = render(helm, "podSecurityContext.runAsUser=4242", "securityContext.runAsUser=4343")
    pod = the(custom, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 4242
    assert container(custom)["securityContext"]["runAsUser"] == 4343
    assert container(custom)["securityContext"]["readOnlyRootFilesystem"] is True  # merged
    dropped = render(helm, "securityContext.readOnlyRootFilesystem=null")
    assert "readOnlyRootFilesystem" not in container(dropped)["securityContext"]


def test_extra_args_follow_the_charts_and_parse(helm):
    from rolloutrun_runtime.cli import build_parser

    args = container(render(helm, "extraArgs={--priority=7}", "peering.enabled=true"))["args"]
    assert args[-1] == "--priority=7"
    assert build_parser().parse_args(args).priority == 7  # the last one wins


def test_the_metrics_port_comes_from_values(helm):
    docs = render(helm, "metrics.port=9100")
    assert "--metrics-port=9100" in container(docs)["args"]
    service = the(docs, "Service")
    assert service["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9100",
    }
    assert service["spec"]["ports"][0]["port"] == 9100
    assert {p["name"]: p["containerPort"] for p in container(docs)["ports"]}["metrics"] == 9100
    mine = template(helm, "--set-string=metrics.serviceAnnotations.prometheus\\.io/port=1234")
    assert mine.returncode == 0, mine.stderr
    assert 'prometheus.io/port: "1234"' in mine.stdout  # the user's wins


def test_a_pdb_only_with_several_replicas(helm):
    assert not [d for d in render(helm) if d["kind"] == "PodDisruptionBudget"]
    assert not [
        d
        for d in render(helm, "peering.enabled=true", "peering.replicas=1")
        if d["kind"] == "PodDisruptionBudget"
    ]
    docs = render(helm, "peering.enabled=true")
    pdb = the(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    labels = the(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    off = render(helm, "peering.enabled=true", "podDisruptionBudget.enabled=false")
    assert not [d for d in off if d["kind"] == "PodDisruptionBudget"]


def test_the_service_monitor_is_optional_and_selects_the_metrics_service(helm):
    assert not [d for d in render(helm) if d["kind"] == "ServiceMonitor"]
    docs = render(helm, *VARIANTS["everything"])
    monitor = the(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = the(docs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    secret = the(docs, "Secret")["metadata"]["name"]
    assert monitor["spec"]["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "interval": "30s",
            "authorization": {"type": "Bearer", "credentials": {"name": secret, "key": "token"}},
        }
    ]
    assert service["spec"]["ports"][0]["name"] == "metrics"
    refused = template(helm, "metrics.serviceMonitor.enabled=true", "metrics.service=false")
    assert refused.returncode != 0 and "needs metrics.service=true" in refused.stderr


def test_the_operators_metrics_need_the_charts_token_secret(helm):
    """The operator serves /metrics (on 0.0.0.0) only with a token file: the chart's own
    Secret, random per install, or one the user names (then the chart creates none)."""
    docs = render(helm, "metrics.serviceMonitor.enabled=true")
    secret = the(docs, "Secret")
    name = secret["metadata"]["name"]
    assert name == "rr-rolloutrun-operator-metrics-token"
    assert len(secret["data"]["token"]) > 40  # base64 of 43 random characters
    volumes = the(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "metrics-token", "secret": {"secretName": name}} in volumes
    assert (
        "--metrics-token-file=/var/run/secrets/rolloutrun/metrics/token" in container(docs)["args"]
    )
    own = render(
        helm, "metrics.existingTokenSecret=my-token", "metrics.serviceMonitor.enabled=true"
    )
    assert not [d for d in own if d["kind"] == "Secret"]
    volumes = the(own, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "metrics-token", "secret": {"secretName": "my-token"}} in volumes
    credentials = the(own, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]
    assert credentials["credentials"]["name"] == "my-token"
    bad = template(helm, "metrics.existingTokenSecret=My_Token")
    assert bad.returncode != 0 and "/metrics/existingTokenSecret" in bad.stderr


def test_helm_test_pod_checks_the_operators_metrics(helm, tmp_path):
    """The test pod's command, run here against the operator's real metrics server: it
    passes when the operator answers, and fails naming the URL when nothing does."""
    from rolloutrun_operator.metrics import Metrics

    docs = render(helm)
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["automountServiceAccountToken"] is False
    (check,) = pod["spec"]["containers"]
    assert check["securityContext"] == container(docs)["securityContext"]
    command: list[str] = check["command"]
    assert command[-1] == "http://rr-rolloutrun-operator-metrics.ops.svc:9090/metrics"
    assert command[0] == "python"

    # it sends the metrics token from the chart's Secret, mounted where the operator has it
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = check["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    (token_env,) = check["env"]
    assert token_env["value"] == f"{mount['mountPath']}/token"
    assert f"--metrics-token-file={token_env['value']}" in container(docs)["args"]

    token = tmp_path / "token"
    token.write_text("the-metrics-token")
    env = {"PATH": "/usr/bin:/bin", "METRICS_TOKEN_FILE": str(token)}
    metrics = Metrics()
    port = metrics.serve(0, "127.0.0.1", str(token))
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        done = subprocess.run(
            [sys.executable, *command[1:-1], url], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        assert f"the operator answers at {url}" in done.stdout
        other = tmp_path / "other"
        other.write_text("not-the-operators-token")  # a wrong token: 401, the check fails
        wrong = subprocess.run(
            [sys.executable, *command[1:-1], url, "1"],
            capture_output=True,
            text=True,
            env={**env, "METRICS_TOKEN_FILE": str(other)},
        )
        assert wrong.returncode != 0 and "401" in wrong.stdout
    finally:
        metrics.close()
    not_metrics = subprocess.run(
        [sys.executable, *command[1:-1], "http://127.0.0.1:1/metrics", "1"],  # one attempt
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert not_metrics.returncode != 0
    assert "did not answer at http://127.0.0.1:1/metrics" in not_metrics.stderr
    assert not [d for d in render(helm, "metrics.service=false") if d["kind"] == "Pod"]


def notes(helm: Path, *sets: str) -> str:
    args = [str(helm), "install", "rr", str(CHART), "-n", "ops", "--dry-run=client"]
    for value in sets:
        args += ["--set", value]
    out: str = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return out.split("NOTES:", 1)[1]


def test_notes_say_what_was_installed_and_how_to_check_it(helm):
    text = notes(helm)
    assert "1 standalone replica" in text and "Cluster mode" in text
    assert "kubectl -n ops rollout status deployment/rr-rolloutrun-operator" in text
    assert "helm test rr -n ops" in text
    assert "kubectl apply -n default -f examples/tiny-grpo.yaml" in text
    scoped = notes(helm, "watchNamespaces={team-a,team-b}", "peering.enabled=true")
    assert "2 replicas with Kopf peering" in scoped and "team-a, team-b" in scoped
    assert "kubectl get -n team-a kopfpeering rolloutrun -o yaml" in scoped
    assert "kubectl apply -n team-a -f examples/tiny-grpo.yaml" in scoped

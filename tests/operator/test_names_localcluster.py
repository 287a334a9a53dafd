"""Names, reserved env and refused children driven through the operator on the local cluster.

A run whose derived names the API server would refuse (``7b-grpo`` gives Service
``7b-grpo-trainer``, not a DNS-1035 label; a 60-character name gives Services over 63
characters) or whose env overrides a reserved variable ends ``Ready=False``/``InvalidSpec``
naming the rule, and none of its children is created. A child the API refuses (a pod over
the namespace's ResourceQuota, answered 403 as a real API server does) becomes a ``Ready``
condition and a Warning Event naming the child, and the run goes on once the quota allows.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from rolloutrun_localcluster import cel
from rolloutrun_localcluster.controllers import ROOT_CA_CONFIG_MAP
from rolloutrun_localcluster.testing import eventually
from tests.support.operator_cluster import (
    GROUP,
    PLURAL,
    VERSION,
    RunNamespace,
    operator_thread,
)
from tests.support.operator_cluster import rolloutrun as stand_in_run


def rolloutrun(name: str, **trainer: Any) -> dict[str, Any]:
    body = stand_in_run(name, storage_uri="file:///tmp/rolloutrun-names-test", lease_seconds=30)
    body["spec"]["trainer"].update(trainer)
    return body


class Namespace(RunNamespace):
    """A fresh namespace with its operator, and what the tests read in it."""

    def __init__(self, api: Any) -> None:
        super().__init__(api, "nm")

    def reason(self, run: str) -> str:
        return self.ready_condition(run).get("reason", "")

    def children(self) -> list[str]:
        """Every object a run could own in the namespace (what every namespace has aside:
        the default account and the cluster's ``kube-root-ca.crt``)."""
        ns = self.name
        found = [
            *(f"Pod/{o.metadata.name}" for o in self.core.list_namespaced_pod(ns).items),
            *(f"Service/{o.metadata.name}" for o in self.core.list_namespaced_service(ns).items),
            *(f"Secret/{o.metadata.name}" for o in self.core.list_namespaced_secret(ns).items),
            *(
                f"ConfigMap/{o.metadata.name}"
                for o in self.core.list_namespaced_config_map(ns).items
                if o.metadata.name != ROOT_CA_CONFIG_MAP
            ),
            *(
                f"ServiceAccount/{o.metadata.name}"
                for o in self.core.list_namespaced_service_account(ns).items
                if o.metadata.name != "default"
            ),
            *(f"Lease/{o.metadata.name}" for o in self.leases.list_namespaced_lease(ns).items),
        ]
        return sorted(found)

    def events(self, reason: str) -> list[str]:
        items = self.core.list_namespaced_event(self.name).items
        return [e.message for e in items if e.reason == reason]


def test_names_the_api_server_refuses_and_reserved_env_end_invalid_with_no_child(cluster, api):
    ns = Namespace(api)
    long_name = "r" + "x" * 59
    reserved = {"env": [{"name": "ROLLOUTRUN_INCARNATION", "value": "99"}]}
    with operator_thread(cluster, ns.name):
        ns.create_run(rolloutrun("7b-grpo"))
        ns.create_run(rolloutrun(long_name))
        invalid = ["7b-grpo", long_name]
        if cel.available():  # the CRD's CEL rule refuses it at admission, as a real API server
            with pytest.raises(ApiException) as refused:
                ns.create_run(rolloutrun("fenced", **reserved))
            assert refused.value.status == 422
            message = json.loads(refused.value.body)["message"]
            assert 'spec.trainer.env: Invalid value: "object": reserved' in message
        else:  # an API server without CEL: the operator's own parse refuses it
            ns.create_run(rolloutrun("fenced", **reserved))
            invalid.append("fenced")
        for run in invalid:
            eventually(lambda run=run: ns.reason(run) == "InvalidSpec", what=f"{run} invalid")
        assert ns.ready_condition("7b-grpo")["status"] == "False"
        assert (
            "Service name '7b-grpo-trainer' must be a DNS-1035 label"
            in (ns.ready_condition("7b-grpo")["message"])
        )
        assert (
            f"'{long_name}-trainer' must be a DNS-1035 label: 68 characters"
            in (ns.ready_condition(long_name)["message"])
        )
        if "fenced" in invalid:
            assert "ROLLOUTRUN_INCARNATION: reserved" in ns.ready_condition("fenced")["message"]
        eventually(lambda: ns.events("InvalidSpec"), what="an InvalidSpec Event")
        assert ns.children() == []
        for run in invalid:
            body = ns.runs.get_namespaced_custom_object(GROUP, VERSION, ns.name, PLURAL, run)
            assert not (body.get("status") or {}).get("incarnation")


def test_a_child_the_api_refuses_is_a_condition_naming_it_then_the_run_goes_on(cluster, api):
    ns = Namespace(api)
    quota = {"metadata": {"name": "two-pods"}, "spec": {"hard": {"pods": "1"}}}
    ns.core.create_namespaced_resource_quota(ns.name, quota)
    with operator_thread(cluster, ns.name):
        ns.create_run(rolloutrun("quota"))
        eventually(lambda: ns.reason("quota") == "ChildRejected", what="the refusal reported")
        message = ns.ready_condition("quota")["message"]
        assert "the API refused Pod/quota-i1-gym-1: 403 Forbidden" in message
        assert "exceeded quota: two-pods" in message
        eventually(lambda: ns.events("ChildRejected"), what="a ChildRejected Event")
        assert "Pod/quota-i1-gym-1" in ns.events("ChildRejected")[0]
        # The quota raised, any change of the run wakes it: the run starts.
        ns.core.delete_namespaced_resource_quota("two-pods", ns.name, _preload_content=False)
        ns.runs.patch_namespaced_custom_object(
            GROUP, VERSION, ns.name, PLURAL, "quota", {"metadata": {"labels": {"quota": "raised"}}}
        )
        eventually(lambda: ns.reason("quota") == "Running", what="the run running")

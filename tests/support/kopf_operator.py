"""A small test-only Kopf operator: the shape of rolloutrun's operator in miniature.

A ``Widget`` gets a ConfigMap and a Pod child (both adopted, so deleting the Widget
garbage-collects them), a status written through the status subresource, and Kopf's
finalizer (because of the on-delete handler), which records the deletion in a ConfigMap.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kopf

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import kopf_login

GROUP, VERSION, PLURAL = "test.rolloutrun.dev", "v1", "widgets"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "maximum": 10},
                                    "color": {
                                        "type": "string",
                                        "enum": ["red", "blue"],
                                        "default": "red",
                                    },
                                    "command": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                            "status": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            },
                        },
                    }
                },
            }
        ],
    },
}


def build_registry(cluster: LocalCluster) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf_login(cluster)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 30
        settings.watching.reconnect_backoff = 0.1
        settings.posting.level = logging.INFO
        settings.posting.loggers = True  # handler log records become Events (off by default)
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix="test.rolloutrun.dev"
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="test.rolloutrun.dev"
        )
        settings.persistence.finalizer = "test.rolloutrun.dev/finalizer"

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    def create(
        spec: Any, name: str, namespace: Any, body: Any, logger: Any, patch: Any, **_: Any
    ) -> None:
        from kubernetes import client as k8s
        from kubernetes.client import ApiClient

        api = ApiClient(_client_config(cluster))
        try:
            config_map = {
                "metadata": {"name": f"{name}-config"},
                "data": {"size": str(spec["size"])},
            }
            pod = {
                "metadata": {"name": f"{name}-pod", "labels": {"widget": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "main",
                            "image": "none",
                            "command": list(spec.get("command") or ["sleep", "300"]),
                        }
                    ],
                },
            }
            kopf.adopt([config_map, pod], owner=body)
            core: Any = k8s.CoreV1Api(api)
            core.create_namespaced_config_map(namespace, config_map)
            core.create_namespaced_pod(namespace, pod)
        finally:
            api.close()
        logger.info("children of %s created", name)
        patch.status["phase"] = "Created"
        patch.status["children"] = 2

    @kopf.on.field(GROUP, VERSION, PLURAL, field="spec.size", registry=registry)
    def resized(new: Any, patch: Any, **_: Any) -> None:
        patch.status["size"] = new

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def delete(name: str, namespace: Any, **_: Any) -> None:
        from kubernetes import client as k8s
        from kubernetes.client import ApiClient

        api = ApiClient(_client_config(cluster))
        try:
            body = {"metadata": {"name": f"{name}-deleted"}, "data": {"by": "kopf"}}
            core: Any = k8s.CoreV1Api(api)
            core.create_namespaced_config_map(namespace, body)
        finally:
            api.close()

    return registry


def _client_config(cluster: LocalCluster) -> Any:
    from kubernetes import client as k8s
    from kubernetes import config

    configuration = k8s.Configuration()
    config.load_kube_config(
        config_file=str(cluster.kubeconfig_path), client_configuration=configuration
    )
    return configuration


class KopfThread:
    """Kopf's ``operator()`` on its own loop in a thread, stopped through its stop flag."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.registry = build_registry(cluster)
        self.namespace = namespace
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="kopf", daemon=True)
        self._level = logging.NOTSET

    def _main(self) -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=self.registry,
                    namespaces=[self.namespace],
                    standalone=True,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                )
            )
        except BaseException as error:
            self.error = error

    def __enter__(self) -> KopfThread:
        # Kopf posts object log records as Events, but only records the logger lets through
        # (``kopf.run`` configures this; ``kopf.operator`` leaves logging to the caller).
        objects = logging.getLogger("kopf.objects")
        self._level = objects.level
        objects.setLevel(logging.INFO)
        self.thread.start()
        if not self.ready_flag.wait(60):
            raise TimeoutError("kopf did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self.thread.join(60)
        logging.getLogger("kopf.objects").setLevel(self._level)

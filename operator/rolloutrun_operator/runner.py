"""Start the operator: in the foreground (``rolloutrun operator``) or in a background thread.

Why both: a cluster runs the operator as its own process, while the embedded default
(``rolloutrun run``) and the tests run it beside a local cluster in one process. Both go
through :func:`run_operator`, so the embedded operator is the same code with the same Kopf
settings, registry and memo as the deployed one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import kopf

from rolloutrun_operator import handlers

logger = logging.getLogger(__name__)


@dataclass
class OperatorConfig:
    """How to run the operator (the command's options, for embedding)."""

    options: handlers.Options = field(default_factory=handlers.Options)
    namespaces: Sequence[str] = ()
    """Watched namespaces; empty: the whole cluster."""
    peering: str | None = None
    """Kopf peering name; None: standalone."""
    priority: int = 0
    liveness: str | None = None
    """Kopf's liveness endpoint URL, e.g. ``http://0.0.0.0:8080/healthz``."""


async def run_operator(
    config: OperatorConfig,
    stop_flag: Any = None,
    ready_flag: Any = None,
    memo: kopf.Memo | None = None,
) -> None:
    """Run Kopf with the RolloutRun handlers until ``stop_flag`` is set (or forever)."""
    peered = config.peering is not None
    memo = memo if memo is not None else kopf.Memo(options=config.options)
    memo["namespaces"] = list(config.namespaces)  # what the operator's own Lease watch follows
    if peered:
        await warn_of_missing_peerings(config)
    await kopf.operator(
        registry=handlers.registry,
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        standalone=not peered,
        peering_name=config.peering,
        priority=config.priority if peered else None,
        liveness_endpoint=config.liveness,
        memo=memo,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def peering_paths(config: OperatorConfig) -> list[tuple[str, str]]:
    """``(description, API path)`` of each peering object Kopf waits for: a
    ClusterKopfPeering when it watches the cluster, a KopfPeering in each watched namespace."""
    name = config.peering
    if name is None:
        return []
    if not config.namespaces:
        return [(f"ClusterKopfPeering {name}", f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}")]
    return [
        (f"KopfPeering {ns}/{name}", f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/{name}")
        for ns in config.namespaces
    ]


async def warn_of_missing_peerings(config: OperatorConfig) -> list[str]:
    """Log an error for each peering object that does not exist; return their descriptions.

    Why: Kopf pauses every watch until its peering object exists and says so only at DEBUG,
    so a missing object looked like an operator that silently did nothing. Not fatal: Kopf
    resumes as soon as the object is created."""
    from rolloutrun_operator.kube import Kube, KubeError, load_credentials

    try:
        kube = Kube(load_credentials(config.options.kubeconfig))
    except Exception as error:  # Kopf's own login reports it
        logger.warning("could not check the peering objects: %s", error)
        return []
    missing = []
    try:
        for description, path in peering_paths(config):
            try:
                await kube.request("GET", path)
            except KubeError as error:
                if error.status != 404:
                    logger.warning("could not check %s (peering): %s", description, error)
                    continue
                missing.append(description)
                logger.error(
                    "%s does not exist: Kopf pauses this operator until it does. Create it "
                    "(the chart does with peering.enabled; its CRD is in the chart's crds/) "
                    "or run without --peering",
                    description,
                )
    finally:
        await kube.close()
    return missing


class OperatorThread:
    """The operator on its own event loop in a daemon thread; a context manager.

    ``error`` holds what ended the operator, if anything did besides :meth:`stop`.
    """

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.memo = kopf.Memo(options=config.options)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="rolloutrun-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run_operator(self.config, self._stop, self._ready, self.memo))
        except BaseException as error:
            self.error = error
        finally:
            self._ready.set()

    def start(self, timeout: float = 60.0) -> OperatorThread:
        """Start and wait until Kopf is ready (raises if it ended instead)."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the operator was not ready within {timeout}s")
        if self.error is not None:
            raise RuntimeError("the operator failed to start") from self.error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

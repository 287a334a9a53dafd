"""Where a run's storage is, for ``rolloutrun audit`` and ``rolloutrun trace``.

Why: on a cluster a user knows the RolloutRun's name, not where its trainer kept things.
The commands take a log directory (the old form), a storage URI (``file://``, ``gs://``) or
``--run NAME [--namespace NS] [--kubeconfig FILE]``, which reads ``spec.storage`` from the
object. A ``file://`` storage lives on a claim the pods mount at the URI's path; from
outside the pods it is reachable only where the claim's volume is a directory of this
machine (``hostPath`` or ``local``, as on the local cluster), so the lookup follows the
claim to its volume and says so plainly when it cannot.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.pod import API_GROUP

#: The RolloutRun resource read (the CRD's version and plural).
RUN_VERSION = "v1alpha1"
RUN_PLURAL = "rolloutruns"


class RunLookupError(RuntimeError):
    """The run, its storage or its claim cannot be found or reached; says which."""


@dataclass(frozen=True)
class RunTarget:
    """What the commands read: the storage URI and, for the old form, a log directory."""

    storage_uri: str
    log_dir: Path | None = None


def add_target_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``TARGET`` (a log directory or a storage URI) or ``--run NAME`` with its cluster."""
    parser.add_argument(
        "target",
        nargs="?",
        default=None,
        help=f"{what}: the run's log directory, or its storage URI (file://..., gs://...)",
    )
    parser.add_argument("--run", default=None, help="a RolloutRun's name (reads spec.storage)")
    parser.add_argument("--namespace", "-n", default="default", help="the RolloutRun's namespace")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")


def resolve_target(args: argparse.Namespace) -> RunTarget:
    """The storage (and log directory) named by ``add_target_arguments``'s arguments."""
    if (args.run is None) == (args.target is None):
        raise RunLookupError("give exactly one of a log directory, a storage URI or --run NAME")
    if args.run is not None:
        return find_run(args.run, args.namespace, args.kubeconfig)
    return target_from_argument(args.target)


def is_storage_uri(text: str) -> bool:
    return text.startswith(("gs://", "file://"))


def target_from_argument(text: str) -> RunTarget:
    """``RUN_DIR`` (its ``checkpoints`` storage) or a storage URI."""
    if is_storage_uri(text):
        return RunTarget(text.rstrip("/") if text != "file:///" else text)
    from rolloutrun_runtime.contract.layout import DEFAULT_STORAGE_DIR

    run_dir = Path(text)
    return RunTarget("file://" + str((run_dir / DEFAULT_STORAGE_DIR).resolve()), run_dir)


def storage_from_run(run: dict[str, Any], claim_host_path: Path | None, where: str) -> RunTarget:
    """The storage of a RolloutRun object; ``claim_host_path``: its claim's volume directory
    on this machine, if any (a ``file://`` storage is read there)."""
    storage = (run.get("spec") or {}).get("storage") or {}
    uri = storage.get("uri")
    if not isinstance(uri, str) or not uri:
        raise RunLookupError(f"{where} has no spec.storage.uri")
    if uri.startswith("gs://"):
        return RunTarget(uri)
    path = Path(uri.removeprefix("file://"))
    if claim_host_path is not None:
        return RunTarget("file://" + str(claim_host_path))
    if path.is_dir():
        return RunTarget("file://" + str(path))
    claim = storage.get("volumeClaimName")
    raise RunLookupError(
        f"{where} keeps its storage {uri} on claim {claim!r}, whose volume is not a directory "
        "of this machine: run the command in a pod that mounts the claim, with the URI "
        f"{uri}"
    )


def find_run(name: str, namespace: str, kubeconfig: str | None = None) -> RunTarget:
    """Read RolloutRun ``namespace/name`` and locate its storage."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    where = f"RolloutRun {namespace}/{name}"
    try:
        api_client = config.new_client_from_config(config_file=kubeconfig)
    except (ConfigException, OSError) as error:
        raise RunLookupError(f"no usable kubeconfig: {error}") from error
    with api_client:
        try:
            found = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
                API_GROUP, RUN_VERSION, namespace, RUN_PLURAL, name
            )
        except ApiException as error:
            raise RunLookupError(f"{where}: {error.status} {error.reason}") from None
        run: dict[str, Any] = found if isinstance(found, dict) else {}
        claim = ((run.get("spec") or {}).get("storage") or {}).get("volumeClaimName")
        host_path = _claim_directory(client.CoreV1Api(api_client), namespace, claim)
    return storage_from_run(run, host_path, where)


def _claim_directory(core: Any, namespace: str, claim: str | None) -> Path | None:
    """The directory of a bound claim's volume on this machine, if it is one."""
    from kubernetes.client.exceptions import ApiException

    if not claim:
        return None
    try:
        pvc = core.read_namespaced_persistent_volume_claim(claim, namespace)
        volume = pvc.spec.volume_name
        if not volume:
            return None
        spec = core.read_persistent_volume(volume).spec
    except ApiException:
        return None
    source = spec.host_path or spec.local
    path = Path(source.path) if source is not None and source.path else None
    return path if path is not None and path.is_dir() else None

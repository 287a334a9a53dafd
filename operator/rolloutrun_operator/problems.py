"""What the CRD schema cannot reject but the operator cannot run: reasons, never crashes.

Why: a bad spec must end as a clear ``Ready=False`` condition (with the reason and what to
fix), not as an exception that makes Kopf retry the handler forever. These checks run before
an incarnation starts; a fixed spec (or a Secret created later) lets the next pass go on.

The same goes for a member pod the kubelet or the scheduler holds back (an image that
cannot be pulled, a container that cannot be created, no node that fits): without
:func:`pod_problem` such a run only said ``StartingGyms`` for as long as it lasted.
"""

from __future__ import annotations

from collections.abc import Iterable

from rolloutrun_operator import builders, naming
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.api.validation import name_problems
from rolloutrun_operator.observe import Observed, PodView
from rolloutrun_runtime.contract.run_config import ConfigError

#: (reason, message) pairs, reasons CamelCase as conditions want them.
Problem = tuple[str, str]


def storage_problem(run: RolloutRun) -> str | None:
    """Why the operator cannot use ``spec.storage``, or None."""
    storage = run.spec.storage
    uri = storage.uri
    if uri.startswith("gs://"):
        if storage.volume_claim_name is not None:
            return "storage.volumeClaimName is for file:// storage, not gs://"
        return None
    path = builders.storage_path(uri)
    if path.rstrip("/") == "":
        return f"storage.uri {uri!r} names no directory (e.g. file:///data/checkpoints)"
    if storage.credentials_secret is not None:
        return "storage.credentialsSecret is for gs:// storage, not file://"
    if storage.gym_credentials_secret is not None:
        return "storage.gymCredentialsSecret is for gs:// storage, not file://"
    if ".." in path.split("/"):
        return f"storage.uri {uri!r} must be an absolute path without '..'"
    return None


def spec_problems(run: RolloutRun, observed: Observed) -> list[Problem]:
    """Everything that stops the next incarnation from starting, most fundamental first."""
    problems: list[Problem] = []
    names = name_problems(run)  # the operator's parse refuses these first (InvalidSpec)
    if names:
        problems.append(("InvalidSpec", "; ".join(names)))
    storage = storage_problem(run)
    if storage is not None:
        problems.append(("StorageUnusable", storage))
    try:
        builders.render_run_config(run)
    except ConfigError as error:
        problems.append(("InvalidRunConfig", str(error)))
    missing = [
        secret for secret in builders.referenced_secrets(run) if secret not in observed.secrets
    ]
    if missing:
        problems.append(
            (
                "SecretNotFound",
                f"Secret(s) {', '.join(missing)} not found in namespace "
                f"{builders.run_namespace(run)}; create them and the run starts",
            )
        )
    return problems


def pod_problem(pod: PodView) -> Problem | None:
    """Why ``pod`` does not start, as the kubelet or the scheduler said, or None.

    The reason is the role and the kubelet's (or the scheduler's) own reason, e.g.
    ``GymImagePullBackOff``, ``TrainerCrashLoopBackOff``, ``GymUnschedulable``; the message
    names the pod, the container and what the kubelet or the scheduler wrote."""
    if pod.deletion_time is not None or pod.terminated:
        return None
    role = "Trainer" if pod.role == naming.Role.TRAINER else "Gym"
    if pod.unschedulable is not None:
        return f"{role}Unschedulable", f"pod {pod.name} unschedulable: {pod.unschedulable}"
    waiting = pod.waiting
    if waiting is None:
        return None
    reason = "".join(ch for ch in waiting.reason if ch.isalnum() or ch == "_")[:100]
    message = f"pod {pod.name} container {waiting.container}: {waiting.reason}"
    if waiting.message:
        message += f": {waiting.message}"
    return f"{role}{reason or 'Waiting'}", message


def first_pod_problem(pods: Iterable[PodView | None]) -> Problem | None:
    """The first of ``pods`` that the kubelet or the scheduler holds back, or None."""
    for pod in pods:
        problem = pod_problem(pod) if pod is not None else None
        if problem is not None:
            return problem
    return None

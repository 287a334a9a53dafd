"""What the CRD schema cannot reject but the operator cannot run: reasons, never crashes.

Why: a bad spec must end as a clear ``Ready=False`` condition (with the reason and what to
fix), not as an exception that makes Kopf retry the handler forever. These checks run before
an incarnation starts; a fixed spec (or a Secret created later) lets the next pass go on.
"""

from __future__ import annotations

from rolloutrun_operator import builders
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.api.validation import name_problems
from rolloutrun_operator.observe import Observed
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

"""What a run may use besides what its spec says: only children it owns, and a named
ServiceAccount only if that account opted in.

Why: names and labels are not proof of anything in a shared namespace. A neighbour can
pre-create ``<run>-gym-token`` with a token it knows, a ``<run>-member`` Role, or the
``<run>-trainer`` Lease held at a high incarnation (fencing the run forever), or label its
own pod ``rolloutrun.dev/run=<run>``. So a child counts only when its controller owner
reference carries the run's uid (:func:`~rolloutrun_operator.observe.owned_by`); anything
else with a child's name is a ``ChildConflict`` the run reports and waits out, never adopts.
Likewise ``spec.serviceAccountName`` would let a RolloutRun author run the trainer (token
mounted) as any account in the namespace; the account's owner must consent with the
:data:`~rolloutrun_operator.naming.ANNOTATION_ALLOW_RUNS` annotation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rolloutrun_operator import builders, naming
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.observe import Observed

#: The reason of ``Ready=False`` (and the Event) while an object the run does not own
#: holds one of its children's names.
CHILD_CONFLICT = "ChildConflict"


def allows_run(annotations: Mapping[str, str], run: str) -> bool:
    """Whether a ServiceAccount with ``annotations`` lets the run named ``run`` use it."""
    value = annotations.get(naming.ANNOTATION_ALLOW_RUNS, "").strip()
    if value.lower() in ("true", "*"):
        return True
    return run in {item.strip() for item in value.split(",") if item.strip()}


def account_problem(run: RolloutRun, observed: Observed) -> tuple[str, str] | None:
    """Why the run may not use the ServiceAccount its spec names, or None."""
    account = run.spec.service_account_name
    if account is None:
        return None
    namespace, name = builders.run_namespace(run), builders.run_name(run)
    if observed.account is None:
        return (
            "ServiceAccountNotFound",
            f"spec.serviceAccountName: ServiceAccount {account!r} not found in namespace "
            f"{namespace}",
        )
    if not allows_run(observed.account, name):
        return (
            "ServiceAccountNotAllowed",
            f"spec.serviceAccountName: ServiceAccount {account!r} does not allow this run: "
            f'its owner must annotate it {naming.ANNOTATION_ALLOW_RUNS}: "true" (every run '
            f"in {namespace}) or a comma-separated list of run names including {name!r}",
        )
    return None


def conflicts(observed: Observed, wanted: Iterable[str]) -> list[tuple[str, str]]:
    """``(Kind/name, owner)`` of each ``wanted`` child held by an object the run does not own."""
    return [(ref, observed.foreign[ref]) for ref in wanted if ref in observed.foreign]


def conflict_message(found: Iterable[tuple[str, str]]) -> str:
    """One line naming each conflicting object and its owner, and what to do."""
    named = "; ".join(
        f"{ref} exists and is not owned by this run (owner: {owner})" for ref, owner in found
    )
    return f"{named}; it is not used: delete or rename it and the run goes on"

"""The API server's naming rules, checked on every name a run derives before any API call.

Why: a run's children are named after the run (:mod:`naming`), and the API server validates
each kind's name by its own rule: Services are DNS-1035 labels (a run named ``7b-grpo``
yields Service ``7b-grpo-trainer``, refused with 422 on every pass), other objects DNS-1123
subdomains, label values at most 63 characters (the run name is the value of the run label,
so a longer one makes the pod label selector a 400 before anything else is looked at). The
operator checks them itself, before creating anything: a bad name ends as
``Ready=False``/``InvalidSpec`` naming the rule and the name, never as a retry loop. The
patterns are those of :mod:`~rolloutrun_operator.kube_names`, which the local cluster enforces.

Pure functions: each ``*_problem`` returns why a string breaks its rule, or None;
:func:`run_name_problems` lists every derived name with the rule its kind must follow.
``rolloutrun validate`` runs them offline through :mod:`~rolloutrun_operator.api.validation`.
"""

from __future__ import annotations

from collections.abc import Callable

from rolloutrun_operator import kube_names, naming

MAX_LABEL = kube_names.DNS1123_LABEL_MAX
MAX_SUBDOMAIN = kube_names.DNS1123_SUBDOMAIN_MAX
MAX_INCARNATION = 99_999
"""The largest incarnation whose pod names are checked to fit a DNS label (63 characters,
so the pod's hostname is its whole name). Later incarnations still get valid pod names
(the API server allows 253 characters); only their hostnames are truncated."""

# The API server's own patterns (one spelling, shared with the local cluster's validation).
_DNS1035_LABEL = kube_names.DNS1035_LABEL
_DNS1123_LABEL = kube_names.DNS1123_LABEL
_DNS1123_SUBDOMAIN = kube_names.DNS1123_SUBDOMAIN
_LABEL_VALUE = kube_names.LABEL_VALUE

Check = Callable[[str], "str | None"]


def _too_long(name: str, limit: int) -> str | None:
    if len(name) > limit:
        return f"{len(name)} characters, at most {limit} allowed"
    return None


def dns1035_label_problem(name: str) -> str | None:
    """Service names: lowercase letters, digits and '-', starting with a letter."""
    if not name:
        return "empty"
    too_long = _too_long(name, MAX_LABEL)
    if too_long or _DNS1035_LABEL.fullmatch(name):
        return too_long
    return "only lowercase letters, digits and '-', starting with a letter, ending alphanumeric"


def dns1123_label_problem(name: str) -> str | None:
    """Pod names as hostnames: lowercase letters, digits and '-', alphanumeric at both ends."""
    if not name:
        return "empty"
    too_long = _too_long(name, MAX_LABEL)
    if too_long or _DNS1123_LABEL.fullmatch(name):
        return too_long
    return "only lowercase letters, digits and '-', starting and ending alphanumeric"


def dns1123_subdomain_problem(name: str) -> str | None:
    """Most objects' names: DNS-1123 labels joined by '.', at most 253 characters."""
    if not name:
        return "empty"
    too_long = _too_long(name, MAX_SUBDOMAIN)
    if too_long or _DNS1123_SUBDOMAIN.fullmatch(name):
        return too_long
    return "only lowercase letters, digits, '-' and '.', starting and ending alphanumeric"


def label_value_problem(value: str) -> str | None:
    """A label value: at most 63 characters of letters, digits, '-', '_', '.'."""
    too_long = _too_long(value, MAX_LABEL)
    if too_long or _LABEL_VALUE.fullmatch(value):
        return too_long
    return "only letters, digits, '-', '_' and '.', starting and ending alphanumeric"


RULES: dict[Check, str] = {
    dns1035_label_problem: "DNS-1035 label",
    dns1123_label_problem: "DNS-1123 label",
    dns1123_subdomain_problem: "DNS-1123 subdomain",
    label_value_problem: "label value",
}


def derived_names(run: str, replicas: int) -> list[tuple[str, str, Check]]:
    """``(what, name, rule)`` for the run name and every name derived from it, the pods at
    the largest incarnation and Gym index checked (:data:`MAX_INCARNATION`)."""
    last = max(replicas - 1, 0)
    return [
        (f"label {naming.LABEL_RUN} value", run, label_value_problem),
        ("trainer Service name", naming.trainer_service_name(run), dns1035_label_problem),
        ("Gym Service name", naming.gym_service_name(run), dns1035_label_problem),
        (
            "trainer pod name",
            naming.trainer_pod_name(run, MAX_INCARNATION),
            dns1123_label_problem,
        ),
        (
            "Gym pod name",
            naming.gym_pod_name(run, MAX_INCARNATION, last),
            dns1123_label_problem,
        ),
        ("Lease name", naming.lease_name(run), dns1123_subdomain_problem),
        ("Secret name", naming.gym_token_secret_name(run), dns1123_subdomain_problem),
        (
            "metrics Secret name",
            naming.metrics_token_secret_name(run),
            dns1123_subdomain_problem,
        ),
        ("ConfigMap name", naming.config_map_name(run), dns1123_subdomain_problem),
        (
            "ServiceAccount/Role/RoleBinding name",
            naming.member_account_name(run),
            dns1123_subdomain_problem,
        ),
        (
            "Gym NetworkPolicy name",
            naming.gym_network_policy_name(run),
            dns1123_subdomain_problem,
        ),
        (
            "generation NetworkPolicy name",
            naming.generation_network_policy_name(run),
            dns1123_subdomain_problem,
        ),
        (
            "worker NetworkPolicy name",
            naming.worker_network_policy_name(run),
            dns1123_subdomain_problem,
        ),
    ]


def run_name_problems(run: str, replicas: int) -> list[str]:
    """Every rule a name derived from run name ``run`` breaks, one line each, naming the
    rule, the offending name and the longest run name that would fit."""
    problems = []
    for what, name, check in derived_names(run, replicas):
        why = check(name)
        if why is not None:
            problems.append(f"{what} {name!r} must be a {RULES[check]}: {why}")
    if problems and len(run) > max_run_name(replicas):
        problems.append(
            f"with {replicas} Gym replica(s), a run name has at most "
            f"{max_run_name(replicas)} characters"
        )
    return problems


def max_run_name(replicas: int) -> int:
    """The longest run name whose derived names all fit (given ``replicas`` Gym pods)."""
    last = max(replicas - 1, 0)
    suffixes = (
        naming.trainer_service_name(""),
        naming.gym_service_name(""),
        naming.trainer_pod_name("", MAX_INCARNATION),
        naming.gym_pod_name("", MAX_INCARNATION, last),
    )
    return MAX_LABEL - max(len(suffix) for suffix in suffixes)


# ------------------------------------------------------------------------ mount paths
#: Where every member pod mounts a volume of ours (the builders' ``_pod``; a test keeps
#: this list equal to what they build).
OWN_MOUNT_PATHS = (naming.CONFIG_DIR, naming.WORK_DIR, "/tmp")


def storage_mount_problem(path: str) -> str | None:
    """Why a claim cannot be mounted at ``path`` (a ``file://`` storage path), or None.

    Refused rather than moved: the path is where the trainer and the Gym write (it is in
    their config), so a claim mounted elsewhere would not hold their files. Equal to one of
    our mount paths is a duplicate ``mountPath`` (422); above one hides it; inside the
    read-only config directory it cannot be created."""
    own = "/" + path.strip("/")
    for mount in OWN_MOUNT_PATHS:
        if own == mount or mount.startswith(own + "/"):
            return (
                f"storage path {own!r} with a volumeClaimName would be mounted over the pods' "
                f"own {mount!r} volume; choose a directory of its own (e.g. /data/checkpoints)"
            )
    if own.startswith(naming.CONFIG_DIR + "/"):
        return f"storage path {own!r} lies inside the read-only {naming.CONFIG_DIR!r}"
    return None

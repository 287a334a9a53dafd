"""The RolloutRun API's own rules across fields (the RunConfig's are in the runtime's contract).

Each is a :class:`~rolloutrun_runtime.contract.field_rules.FieldRule`: its CEL goes into the
generated CRD (``x-kubernetes-validations``), and the models' validators and
:mod:`~rolloutrun_operator.api.validation` raise its message. The rule across the spec's
sections (preemption grace below the termination grace) is built from the models' defaults
by :mod:`~rolloutrun_operator.api.v1alpha1`.
"""

from __future__ import annotations

from rolloutrun_runtime.contract.field_rules import FieldRule
from rolloutrun_runtime.contract.pod import RESERVED_ENV

#: The operator's own variables carry fencing and identity: a user's entry would win.
RESERVED_ENV_RULE = FieldRule(
    rule=(
        "!has(self.env) || self.env.all(e, !(e.name in ["
        + ", ".join(f"'{name}'" for name in sorted(RESERVED_ENV))
        + "]))"
    ),
    message=(
        "reserved, the operator sets it on every member pod (reserved names: "
        + ", ".join(sorted(RESERVED_ENV))
        + ")"
    ),
    field_path=".env",
)


#: A path no volume holds lies in each pod's own filesystem and dies with it.
STORAGE_NEEDS_CLAIM = FieldRule(
    rule="self.uri.startsWith('gs://') || has(self.volumeClaimName)",
    message=(
        "required with file:// storage: without a volume the path lies in each pod's own "
        "filesystem and dies with the pod, losing every checkpoint; name a ReadWriteMany "
        "PersistentVolumeClaim, or use gs://"
    ),
    field_path=".volumeClaimName",
    reason="FieldValueRequired",
)


def grace_below_termination(preemption_default: int, termination_default: int) -> FieldRule:
    """The forced snapshot on SIGTERM must publish before the kubelet's SIGKILL; the sections
    may be absent (no defaulting reaches into them), so their defaults stand in."""
    return FieldRule(
        rule=(
            "(has(self.run) && has(self.run.checkpointing) ? "
            f"self.run.checkpointing.preemptionGraceSeconds : {preemption_default}) < "
            "(has(self.trainer) ? self.trainer.terminationGracePeriodSeconds : "
            f"{termination_default})"
        ),
        message=(
            "spec.run.checkpointing.preemptionGraceSeconds must be below "
            "spec.trainer.terminationGracePeriodSeconds: the trainer's forced snapshot "
            "publishes within the first, the kubelet kills the trainer at the second"
        ),
    )

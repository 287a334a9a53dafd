"""Building blocks the RolloutRun API and its pod templates share (env, resources, tolerations).

Why its own module: :mod:`~rolloutrun_operator.api.v1alpha1` embeds
:mod:`~rolloutrun_operator.api.pod_template`, and both use these; kept here, neither imports
the other's half. :mod:`~rolloutrun_operator.api.v1alpha1` re-exports every name.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict

#: Kubernetes resource quantities ("500m", "2", "4Gi").
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]i?|Ki)?$"
#: Label/selector keys and values, and other Kubernetes names.
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


_QUANTITY_VALUE: JsonDict = {"type": "string", "maxLength": 64, "pattern": QUANTITY_PATTERN}
_LABEL_VALUE: JsonDict = {"type": "string", "maxLength": 63}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True
    )


class ResourceRequirements(_Model):
    """Compute resources of a container, as in a Pod spec."""

    requests: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description='Minimum resources, e.g. {"cpu": "2", "memory": "8Gi"}.',
        json_schema_extra={"additionalProperties": _QUANTITY_VALUE},
    )
    limits: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description='Maximum resources, e.g. {"nvidia.com/gpu": "1"}.',
        json_schema_extra={"additionalProperties": _QUANTITY_VALUE},
    )


class TolerationOperator(enum.StrEnum):
    """How a toleration matches a taint's value."""

    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(enum.StrEnum):
    """The taint effect a toleration matches (empty: all)."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(_Model):
    """A Pod toleration, e.g. for spot or GPU node taints."""

    key: str | None = Field(None, max_length=317, description="Taint key; empty matches all.")
    operator: TolerationOperator = Field(TolerationOperator.EQUAL, description="Exists or Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value for Equal.")
    effect: TaintEffect | None = Field(None, description="Effect to match; empty matches all.")
    toleration_seconds: int | None = Field(
        None,
        ge=0,
        le=86_400,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )


class KeySelector(_Model):
    """A key of a named Secret or ConfigMap."""

    name: str = Field(
        ..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Its name."
    )
    key: str = Field(..., min_length=1, max_length=253, description="The key within it.")


class EnvVarSource(_Model):
    """Where an environment variable's value comes from."""

    secret_key_ref: KeySelector | None = Field(None, description="A Secret's key.")
    config_map_key_ref: KeySelector | None = Field(None, description="A ConfigMap's key.")


class EnvVar(_Model):
    """An environment variable for a container."""

    name: str = Field(
        ..., min_length=1, max_length=256, pattern=ENV_NAME_PATTERN, description="Variable name."
    )
    value: str | None = Field(None, max_length=32_768, description="A literal value.")
    value_from: EnvVarSource | None = Field(None, description="A Secret or ConfigMap key.")

"""``spec.gym.image``, ``command`` and ``args``: the user's own environment server.

Why optional fields on the Gym pods rather than a new kind of member: the user's server
takes the built-in Gym's place one for one (same replicas, port, Service, NetworkPolicy,
token, instance ids), and serves the same HTTP contract (docs/environment-contract.md);
only what the container runs differs (``builders.gym_pod``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from rolloutrun_operator.api.common import _Model
from rolloutrun_runtime.contract.field_rules import FieldRule

#: A user's server is started by ``command``; ``args`` alone would go to the built-in Gym.
ARGS_NEED_COMMAND = FieldRule(
    rule="!has(self.args) || size(self.args) == 0 || has(self.command)",
    message="gym.args needs gym.command (the built-in Gym takes no args)",
)
#: One word of a command line.
Word = Annotated[str, StringConstraints(max_length=4096)]


class UserServerSettings(_Model):
    """What a Gym pod runs when it runs the user's own environment server."""

    image: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        description=(
            "Image of the user's own environment server (default: images.gym); see "
            "docs/environment-contract.md."
        ),
    )
    command: list[Word] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description=(
            "Run the user's own environment server instead of the built-in Gym: it serves "
            "docs/environment-contract.md on $(POD_IP):$(ROLLOUTRUN_GYM_PORT); $(VAR) "
            "expands as in Kubernetes."
        ),
    )
    args: list[Word] = Field(
        default_factory=list,
        max_length=256,
        description="Arguments of command (with command only).",
    )

    @model_validator(mode="after")
    def _args_need_command(self) -> UserServerSettings:
        if self.args and self.command is None:
            raise ValueError(ARGS_NEED_COMMAND.message)
        return self

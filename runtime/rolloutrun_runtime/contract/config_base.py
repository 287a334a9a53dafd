"""The base of every RunConfig section (``contract/run_config.py``, ``contract/prompt_set.py``).

Why a module of its own: the sections are split over modules (each under 600 lines), and
they must share one rule for names and values; it is spelled here once.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ConfigSection(BaseModel):
    """Base for every config section: camelCase aliases, unknown fields rejected, no NaN or
    infinity in a float (YAML's ``.nan`` would otherwise be refused only by a bound's
    comparison, with a message about the bound instead of the value). ``defer_build``: a
    section's validator is built when first used, not when its class is made; a config is
    validated as one ``RunConfig`` schema, so building each section's own validator at
    import was ~40 ms of a trainer's start-up CPU spent before its first redispatch."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        frozen=False,
        allow_inf_nan=False,
        defer_build=True,
    )

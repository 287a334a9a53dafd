"""YAML read as ``kubectl`` reads it: one loader for every RolloutRun and config file.

Why: a user's file reaches the cluster through ``kubectl`` (Go's YAML, whose plain-scalar
floats are ``1e3``, ``1.0e3``, ``.5``), and reaches ``rolloutrun validate``, ``rolloutrun
run``, ``rolloutrun train`` and the local cluster's YAML bodies through PyYAML, which reads
YAML 1.1 and takes a float only with a dot and a signed exponent (``1.0e+3``): ``maxSteps:
1e3`` was ``1000`` on a real cluster and the string ``"1e3"`` here, refused offline ("is not
of type integer") what ``kubectl apply`` accepts. This loader is PyYAML's safe loader with
Go's float rule added, and what ``kubectl`` sends the API server: JSON, where Go writes a
float with no fraction as an integer (``30.0`` and ``1e3`` arrive as ``30`` and ``1000``,
which an integer field takes). Everything else (YAML 1.1 booleans such as ``yes``, octal
``0777``, ``1_000``) already reads alike in both. Nothing but plain data is built (no tags
that make objects), as with ``yaml.safe_load``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

#: What a file that is not YAML raises (PyYAML's error, so callers need not import it).
YAMLError = yaml.YAMLError
#: Go's YAML (the ``kubectl`` side) resolves a plain scalar matching this as a float.
#: (PyYAML's own rule already takes ``1.0``, ``1.`` and ``.5``; what it lacks is the exponent
#: without a dot or without a sign.)
GO_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$")


#: Go's JSON writes a float64 below this size with no fraction as digits only ("1e+21" above).
GO_JSON_INTEGER_LIMIT = 1e21


def as_sent(value: float) -> float | int:
    """A float as ``kubectl``'s JSON carries it: an integer when it has no fraction."""
    if math.isfinite(value) and value.is_integer() and abs(value) < GO_JSON_INTEGER_LIMIT:
        return int(value)
    return value


class KubeYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with a plain ``1e3`` or ``1.0e3`` read as a float, and a float with
    no fraction as an integer."""

    def construct_yaml_float(self, node: yaml.Node) -> float | int:
        return as_sent(super().construct_yaml_float(node))  # type: ignore[arg-type]


KubeYamlLoader.add_constructor("tag:yaml.org,2002:float", KubeYamlLoader.construct_yaml_float)


# The resolver table is per class: added here, SafeLoader itself is unchanged. Listed under
# the characters a GO_FLOAT can start with, after PyYAML's own rules for them.
KubeYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", GO_FLOAT, list("-+.0123456789"))


def load_yaml(text: str | bytes) -> Any:
    """The one document in ``text`` (None if empty); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=KubeYamlLoader)


def load_yaml_all(text: str | bytes) -> list[Any]:
    """Every document in ``text``, empty ones as None; raises ``yaml.YAMLError``."""
    return list(yaml.load_all(text, Loader=KubeYamlLoader))

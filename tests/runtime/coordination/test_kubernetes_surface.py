"""coordination.py names only what the minimum supported ``kubernetes`` (the pin) offers.

Why: it once called ``ApiClient.param_serialize`` (kubernetes >= 36) under a ``>=29`` pin,
and on 29-35 every Lease call failed. The dynamic half of the check (what a running
KubernetesLease touches on its ApiClient and CoordinationV1Api) is in
test_kubernetes_lease.py; this half reads the module's imports statically.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rolloutrun_runtime import coordination

from .surface import surface

ROOT = Path(__file__).resolve().parents[3]


def kubernetes_names(source: str) -> set[tuple[str, str]]:
    """``(module, name)`` for every kubernetes name the source imports or dereferences."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}
    used: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kubernetes"):
            for alias in node.names:
                if node.module == "kubernetes":
                    modules[alias.asname or alias.name] = f"kubernetes.{alias.name}"
                else:
                    used.add((str(node.module), alias.name))
        elif isinstance(node, ast.Import):
            assert all(not a.name.startswith("kubernetes") for a in node.names), "use from-imports"
    for node in ast.walk(tree):
        name = node.value if isinstance(node, ast.Attribute) else None
        if isinstance(name, ast.Name) and name.id in modules:
            assert isinstance(node, ast.Attribute)
            used.add((modules[name.id], node.attr))
    return used


def test_the_recorded_surface_is_the_pinned_minimum():
    pins = set(re.findall(r'"kubernetes>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()))
    assert len(pins) == 1, f"one minimum kubernetes version, found {pins}"
    (minimum,) = pins
    assert surface()["version"].split(".")[0] == minimum.split(".")[0]
    # the recording really is an old client: the call that broke 29-35 is absent from it
    assert "param_serialize" not in surface()["ApiClient"]


def test_coordination_imports_only_names_the_minimum_version_has():
    used = kubernetes_names(Path(coordination.__file__).read_text())
    assert ("kubernetes.client", "CoordinationV1Api") in used
    modules = surface()["modules"]
    missing = sorted(f"{module}.{name}" for module, name in used if name not in modules[module])
    assert missing == []


def test_the_static_check_sees_a_name_the_minimum_version_lacks():
    source = "from kubernetes import client\nclient.ApiClient().x\nclient.NoSuchApi\n"
    used = kubernetes_names(source)
    assert ("kubernetes.client", "NoSuchApi") in used
    assert "NoSuchApi" not in surface()["modules"]["kubernetes.client"]

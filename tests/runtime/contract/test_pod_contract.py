"""The pod contract is spelled once: no module of the operator or the runtime repeats one of
``rolloutrun_runtime.contract.pod``'s names as a literal (it imports it instead).

This replaces a test that compared the runtime's copies of the names with the operator's
(and left some out): with one spelling there is nothing left to compare, only a copy that
must not come back.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rolloutrun_operator import naming
from rolloutrun_runtime import coordination
from rolloutrun_runtime.contract import pod

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ROOT / "runtime" / "rolloutrun_runtime" / "contract" / "pod.py"


def contract_names() -> dict[str, str]:
    """The contract's distinctive string values (env names, annotations, paths)."""
    names = {}
    for name, value in vars(pod).items():
        if not isinstance(value, str) or name.startswith("_"):
            continue
        if name.startswith(("ENV_", "ANNOTATION_")) or value.startswith("/"):
            names[value] = name
    return names


def literals(path: Path) -> list[tuple[int, str]]:
    """Every string literal of a module that is not a docstring."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_module_spells_a_pod_contract_name_itself():
    names = contract_names()
    assert "ROLLOUTRUN_GYM_CONTROL_TOKEN" in names and "/etc/rolloutrun" in names
    copies = []
    for tree in ("runtime", "operator"):
        for path in sorted((ROOT / tree).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if path == CONTRACT:
                continue
            for line, value in literals(path):
                if value in names:
                    copies.append(f"{relative}:{line}: {value!r} (contract.pod.{names[value]})")
    assert not copies, "\n".join(copies)


def test_both_sides_read_the_contract_objects():
    assert naming.ENV_GYM_TOKEN is pod.ENV_GYM_TOKEN
    assert naming.holder_identity is pod.holder_identity is coordination.holder_identity
    assert naming.holder_incarnation is pod.holder_incarnation is coordination.incarnation_of
    assert coordination.ANNOTATION_LATEST_MANIFEST is pod.ANNOTATION_LATEST_MANIFEST
    assert pod.holder_incarnation(pod.holder_identity("p", 3)) == 3

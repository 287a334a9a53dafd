"""The operator's shape: one module with Kopf decorators; decisions and builders pure."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "rolloutrun_operator"
PURE = (
    "reconcile.py",
    "losses.py",
    "builders.py",
    "observe.py",
    "conditions.py",
    "plan.py",
    "problems.py",
    "name_rules.py",
    "ownership.py",
)


def modules() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "localcluster" not in p.parts]


def kopf_decorated(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target).startswith("kopf."):
                    found.append(node.name)
    return found


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_handlers_module_carries_kopf_decorators():
    decorated = {p.name: kopf_decorated(p) for p in modules() if kopf_decorated(p)}
    assert set(decorated) == {"handlers.py"}
    assert "keep_running" in decorated["handlers.py"]


def test_decisions_and_builders_do_no_io():
    for name in PURE:
        used = imported(PACKAGE / name)
        assert not used & {"kopf", "kubernetes", "aiohttp", "asyncio", "socket", "os"}, name


def test_the_check_sees_a_decorator(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "@kopf.on.event('v1', 'pods')\ndef f(**_): pass\n\n@kopf.timer\ndef g(): pass\n"
    )
    assert kopf_decorated(probe) == ["f", "g"]

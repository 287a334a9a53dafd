"""The import rules of ARCHITECTURE.md §2, checked on every module's AST.

An AST scan (rather than import-linter) also sees imports inside functions, which is where
lazy imports of heavy or forbidden packages would hide.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "operator" / "rolloutrun_operator"
RUNTIME = ROOT / "runtime" / "rolloutrun_runtime"


def module_name(path: Path) -> str:
    base = path.parents[len(path.relative_to(ROOT).parts) - 2]
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """Every module a file imports (absolute names), with line numbers."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module or module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)
    return found


def violations(root: Path, rule) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, name in imports_of(path):
            reason = rule(module_name(path), name)
            if reason:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {name} ({reason})")
    return bad


def _top(name: str) -> str:
    return name.split(".")[0]


#: Only the local cluster itself and the embedded default (`rolloutrun run`) may import it;
#: the operator's reconcile code, builders and handlers must run unchanged on a real cluster.
LOCALCLUSTER_USERS = ("rolloutrun_localcluster", "rolloutrun_localcluster.embedded")


def operator_rule(source: str, name: str) -> str | None:
    if _top(name) in {"torch", "ray"} or name.startswith("google.cloud"):
        return "the operator never imports torch, ray or google.cloud"
    if _top(name) == "rolloutrun_runtime" and not (
        name == "rolloutrun_runtime" or name.startswith("rolloutrun_runtime.contract")
    ):
        return "the operator reaches the runtime only through rolloutrun_runtime.contract"
    if name.startswith("rolloutrun_localcluster") and not source.startswith(LOCALCLUSTER_USERS):
        return "reconcile code never imports the local cluster"
    return None


ENV_CHECKPOINTING = "rolloutrun_runtime.environments.checkpointing"
ENV_BACKENDS = {
    path.stem
    for path in (RUNTIME / "environments" / "checkpointing").glob("*.py")
    if path.stem not in {"__init__", "interfaces"}
}


def backend_module(name: str) -> str | None:
    """The environment-checkpoint backend module ``name`` reaches into, if any."""
    prefix = ENV_CHECKPOINTING + "."
    if not name.startswith(prefix):
        return None
    first = name[len(prefix) :].split(".")[0]
    return first if first in ENV_BACKENDS else None


def runtime_rule(source: str, name: str) -> str | None:
    if _top(name) == "kopf":
        return "the runtime never imports kopf"
    if _top(name) == "rolloutrun_operator":
        return "the runtime never imports the operator (commands plug in through entry points)"
    if _top(name) == "kubernetes" and source != "rolloutrun_runtime.coordination":
        return "only rolloutrun_runtime.coordination may import kubernetes"
    halves = {
        "rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots",
        "rolloutrun_runtime.algorithms.rollout_checkpointing.restore",
    }
    if source in halves and any(name.startswith(h) for h in halves - {source}):
        return "snapshots and restore never import each other"
    backend = backend_module(name)
    if backend and not source.startswith("rolloutrun_runtime.environments"):
        return f"backend-specific environment code ({backend}) is reached only through the builder"
    return None


def test_operator_imports_follow_the_rules():
    assert violations(OPERATOR, operator_rule) == []


def test_runtime_imports_follow_the_rules():
    assert violations(RUNTIME, runtime_rule) == []


def test_the_rule_checker_catches_a_lazy_forbidden_import(tmp_path):
    fake = tmp_path / "lazy.py"
    fake.write_text("def f():\n    import kopf\n    from torch import nn\n")
    names = [name for _, name in imports_of(fake, "rolloutrun_runtime.lazy")]
    assert "kopf" in names and "torch" in names
    assert runtime_rule("rolloutrun_runtime.x", "kopf")
    assert operator_rule("rolloutrun_operator.x", "torch.nn")
    assert operator_rule("rolloutrun_operator.x", "rolloutrun_runtime.trainer")
    assert operator_rule("rolloutrun_operator.x", "rolloutrun_runtime.contract.run_config") is None
    assert runtime_rule(
        "rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots",
        "rolloutrun_runtime.algorithms.rollout_checkpointing.restore",
    )
    assert "nemo_gym" in ENV_BACKENDS
    assert runtime_rule(
        "rolloutrun_runtime.algorithms.single_controller",
        "rolloutrun_runtime.environments.checkpointing.nemo_gym.GymSnapshot",
    )
    assert (
        runtime_rule(
            "rolloutrun_runtime.algorithms.rollout_checkpointing.restore",
            "rolloutrun_runtime.environments.checkpointing.EnvironmentCheckpoint",
        )
        is None
    )


def test_plain_folders_do_not_shadow_the_standard_library():
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "runtime" / "__init__.py").exists()
    out = subprocess.run(
        [sys.executable, "-c", "import operator, typing; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "/operator/" not in out.replace(str(ROOT), "")


@pytest.mark.parametrize("package", [OPERATOR, RUNTIME])
def test_every_module_says_why(package):
    missing = [
        str(path.relative_to(ROOT))
        for path in sorted(package.rglob("*.py"))
        if path.read_text().strip() and ast.get_docstring(ast.parse(path.read_text())) is None
    ]
    assert missing == []

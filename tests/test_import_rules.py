"""The import rules of ARCHITECTURE.md §2: the import-linter contracts hold, plus the one rule
they cannot say.

The rules themselves are declared once, as import-linter contracts in ``pyproject.toml``
(``make lint`` runs ``lint-imports``; :func:`test_the_import_contracts_hold` runs it too, so a
plain ``pytest`` guards them as well). They see imports inside functions and under
``TYPE_CHECKING``, where lazy imports of heavy or forbidden packages would hide
(:func:`test_import_linter_sees_lazy_imports`). What stays here is an AST scan for the rule
a contract cannot state without naming every backend file: backend-specific environment
checkpoint code is reached only through the builder.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "operator" / "rolloutrun_operator"
LOCALCLUSTER = ROOT / "operator" / "rolloutrun_localcluster"
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


def backend_rule(source: str, name: str) -> str | None:
    backend = backend_module(name)
    if backend and not source.startswith("rolloutrun_runtime.environments"):
        return f"backend-specific environment code ({backend}) is reached only through the builder"
    return None


def _lint_imports(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` of this interpreter's environment, with this checkout first on the path
    (an editable install made before a package was added does not know it)."""
    path = [str(ROOT / "operator"), str(ROOT / "runtime"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    command = [str(Path(sys.executable).with_name("lint-imports")), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


def test_the_import_contracts_hold():
    done = _lint_imports("--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr


def test_import_linter_sees_lazy_imports(tmp_path):
    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package whose forbidden import hides."""\n')
    (package / "lazy.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import torch\n\n\n"
        "def f():\n    import kopf\n"
    )
    (tmp_path / "pyproject.toml").write_text(
        '[tool.importlinter]\nroot_packages = ["lazypkg"]\ninclude_external_packages = true\n'
        '[[tool.importlinter.contracts]]\nname = "light"\ntype = "forbidden"\n'
        'source_modules = ["lazypkg"]\nforbidden_modules = ["kopf", "torch"]\n'
    )
    done = _lint_imports("--no-cache", cwd=tmp_path)
    assert done.returncode == 1
    assert "lazypkg.lazy -> kopf" in done.stdout and "lazypkg.lazy -> torch" in done.stdout


def test_backend_code_is_reached_only_through_the_builder():
    assert violations(RUNTIME, backend_rule) == []


def test_the_rule_checker_catches_a_lazy_backend_import(tmp_path):
    fake = tmp_path / "lazy.py"
    fake.write_text(
        "def f():\n    from rolloutrun_runtime.environments.checkpointing import nemo_gym\n"
    )
    names = [name for _, name in imports_of(fake, "rolloutrun_runtime.lazy")]
    assert "rolloutrun_runtime.environments.checkpointing.nemo_gym" in names
    assert "nemo_gym" in ENV_BACKENDS
    assert backend_rule("rolloutrun_runtime.lazy", names[-1])
    assert backend_rule(
        "rolloutrun_runtime.algorithms.single_controller",
        "rolloutrun_runtime.environments.checkpointing.nemo_gym.GymSnapshot",
    )
    assert (
        backend_rule(
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


@pytest.mark.parametrize("package", [OPERATOR, LOCALCLUSTER, RUNTIME])
def test_every_module_says_why(package):
    missing = [
        str(path.relative_to(ROOT))
        for path in sorted(package.rglob("*.py"))
        if path.read_text().strip() and ast.get_docstring(ast.parse(path.read_text())) is None
    ]
    assert missing == []

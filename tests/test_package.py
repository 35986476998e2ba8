"""The package's face: lazy exports, one meaning per name."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import autosplit


def test_import_does_not_load_tensorflow():
    code = "import sys, autosplit; autosplit.__version__; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_every_export_resolves_and_the_functions_stay_functions_after_every_import():
    modules = {m.name for m in pkgutil.iter_modules(autosplit.__path__)} - {"__main__"}
    for name in modules:
        importlib.import_module(f"autosplit.{name}")
    for name in autosplit.__all__:
        assert getattr(autosplit, name) is not None, name
    # No submodule shares a name with an export, so importing one never shadows it.
    assert not modules & set(autosplit.__all__)
    assert callable(autosplit.probe) and callable(autosplit.check)
    assert autosplit.probe.__module__ == "autosplit.trials"
    assert autosplit.check.__module__ == "autosplit.equivalence"


def _imported_modules(path) -> set[str]:
    """The autosplit modules ``path`` imports anywhere, inside functions too."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "autosplit":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autosplit."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("autosplit."))
    return names


def test_modules_import_one_way():
    """No cycle, not even through an import inside a function (device <-> host was one)."""
    from pathlib import Path

    files = {p.stem: p for p in Path(autosplit.__file__).parent.glob("*.py")}
    del files["__init__"]
    graph = {name: _imported_modules(path) & set(files) - {name}
             for name, path in files.items()}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for imported in sorted(graph[name]):
                visit(imported, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_train_step_is_internal_and_its_old_export_warns():
    from autosplit.step import TrainStep

    assert "TrainStep" not in autosplit.__all__ and "TrainStep" not in dir(autosplit)
    with pytest.warns(DeprecationWarning, match="autosplit.TrainStep is internal"):
        assert autosplit.TrainStep is TrainStep


def test_mypy_is_strict_on_every_module_behind_all():
    """The strict override in pyproject.toml names where each export is defined."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = Path(autosplit.__file__).parents[1] / "pyproject.toml"
    overrides = tomllib.loads(pyproject.read_text())["tool"]["mypy"]["overrides"]
    (strict,) = [o for o in overrides if o.get("disallow_untyped_defs")]
    defined = {getattr(autosplit, name).__module__ for name in autosplit.__all__
               if name != "__version__"}
    missing = (defined | {"autosplit"}) - set(strict["module"])
    assert not missing, f"add {sorted(missing)} to the strict [[tool.mypy.overrides]]"

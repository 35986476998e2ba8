"""The package's face: lazy exports, one meaning per name."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

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
    assert autosplit.probe.__module__ == "autosplit.search.probe"
    assert autosplit.check.__module__ == "autosplit.equivalence"


PACKAGE = Path(autosplit.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages' __init__ files, which only
    hold a docstring, left out)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The autosplit modules ``path`` imports anywhere, inside functions too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autosplit"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("autosplit."))
    return names & known


def test_modules_import_one_way():
    """No cycle, not even through an import inside a function (device <-> host was one)."""
    files = _modules()
    graph = {name: _imported_modules(path, set(files)) - {name}
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


# Lowest first: a package imports only from packages below it (and itself), and from
# the base modules, which import only each other. The public faces at the top
# (accumulate, equivalence, cli...) import anything; nothing below imports them.
LAYERS = ("keras_hooks", "memory", "data", "step", "search", "training")
BASE = ("errors", "units", "warn", "capped", "graph")


def _level(module: str) -> float:
    """0 for a base module, 1 + its index for a package's module, infinity for a face."""
    part = module.split(".")[1]
    if part in BASE:
        return 0
    return 1 + LAYERS.index(part) if part in LAYERS else float("inf")


def test_imports_run_down_the_layers():
    """docs/development.md's order, held: no import from a lower layer to a higher one,
    inside functions too."""
    files = _modules()
    upward = sorted(
        f"{name} -> {imported}"
        for name, path in files.items()
        for imported in _imported_modules(path, set(files))
        if _level(imported) > _level(name))
    assert not upward, f"imports up the layers: {upward}"


MODULE_LINES, FUNCTION_CODE_LINES = 450, 60


def _code_lines(lines: list[str], node: ast.AST) -> int:
    """A function's lines that hold code: not blank, not a comment, not its docstring."""
    body = node.body
    docstring = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        docstring = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for number in range(node.lineno, node.end_lineno + 1)
               if number not in docstring
               and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#"))


_NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make", "_getframe"}  # public, "_" or not


def _private_reaches(tree: ast.AST) -> list[str]:
    """Private names of other objects a module reaches: ``x._name`` on anything but
    self or cls, ``getattr(x, "_name")``, imports of ``tensorflow.python`` or ``keras.src``."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in _NAMEDTUPLE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"line {node.lineno}: .{node.attr}")
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "getattr", "hasattr", "setattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")
                and not str(node.args[1].value).startswith("__")):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                alias.name for alias in node.names]
            found += [f"line {node.lineno}: import {name}" for name in names
                      if name.startswith(("tensorflow.python", "keras.src"))]
    return found


def test_private_names_are_reached_only_through_keras_hooks():
    # The wall: every private Keras, TensorFlow or tf.data name sits in keras_hooks/,
    # each with a canary in tests/keras_hooks/test_keras_canaries.py.
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "keras_hooks" in path.relative_to(PACKAGE).parts:
            continue
        reaches = _private_reaches(ast.parse(path.read_text()))
        if reaches:
            outside[str(path.relative_to(PACKAGE))] = reaches
    assert not outside, f"private names reached outside keras_hooks/: {outside}"
    assert sorted(_private_reaches(ast.parse("import tensorflow.python.util\nx._inputs()\n"
                                             "getattr(m, '_loss_tracker')"))) == [
        "line 1: import tensorflow.python.util", "line 2: ._inputs",
        "line 3: getattr(..., '_loss_tracker')"]


def test_modules_and_functions_stay_short():
    """A module holds one job (at most 450 lines), a function one step (at most 60 lines
    of code): past that, cut at a seam (docs/development.md)."""
    long_modules, long_functions = [], []
    for name, path in sorted(_modules().items()):
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MODULE_LINES:
            long_modules.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                count = _code_lines(lines, node)
                if count > FUNCTION_CODE_LINES:
                    long_functions.append(f"{name}.{node.name} (line {node.lineno}): {count}")
    assert not long_modules, f"modules over {MODULE_LINES} lines: {long_modules}"
    assert not long_functions, (
        f"functions over {FUNCTION_CODE_LINES} lines of code: {long_functions}")


BENCHMARKS = PACKAGE.parent / "benchmarks"


def test_benchmark_modules_stay_short():
    """The module limit holds in benchmarks/ too (at most 450 lines): a script keeps its
    question, and what it shares or can stand apart goes to a module named for it
    (``harness``, ``plots``, ``workloads``, ``batchnorm_runs``). Only the module limit:
    the 60 lines of code per function are not enforced here, since some benchmark
    functions (``probe_search.run_method``, one search's whole run) are longer."""
    paths = sorted(BENCHMARKS.glob("*.py"))
    assert paths, f"no benchmark modules in {BENCHMARKS}"
    long_modules = [f"{path.name}: {count} lines" for path in paths
                    if (count := len(path.read_text().splitlines())) > MODULE_LINES]
    assert not long_modules, f"benchmark modules over {MODULE_LINES} lines: {long_modules}"


def test_train_step_is_internal_and_its_old_export_warns():
    from autosplit.step.train_step import TrainStep

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

"""The package's face: lazy exports, one meaning per name."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

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

"""MkDocs hooks: the pages that live outside ``docs/``, and the text made from the code.

- ``benchmarks/README.md`` and everything in ``benchmarks/results/`` are served under
  ``benchmarks/``, so the benchmarks' own relative links and plots work unchanged and
  the figures exist once, where the scripts write them. ``CHANGELOG.md`` is the
  changelog page. The pages link to these files where they are in the repository
  (``../benchmarks/README.md``), which works when ``docs/`` is read on GitHub too; such
  links are pointed at the served copies.
- ``<!-- autosplit-help: probe -->`` becomes the output of ``autosplit probe --help``
  (the program itself is asked; its parent process does not load TensorFlow).
- ``<!-- autosplit-modules -->`` becomes a table of the package's modules, each with the
  first paragraph of its docstring (read with ``ast``; nothing is imported).
- The API page must document exactly ``autosplit.__all__``. A name missing from it, or
  one documented there that is no longer exported, is a warning, which fails
  ``mkdocs build --strict`` (as ``make test`` runs it).

``HouseDocstrings`` is a griffe extension (``mkdocs.yml`` loads it for mkdocstrings)
for two habits of the package's docstrings that griffe's Google parser does not know:
doctests headed ``Example:`` (it would render them as an admonition of block quotes; it
reads them as ``Examples:``), and Sphinx roles such as ``:meth:`rebind` `` (shown as
code).
"""

from __future__ import annotations

import ast
import logging
import os
import posixpath
import re
import subprocess
import sys
from pathlib import Path

import griffe
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.plugins.autosplit")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autosplit"
API_PAGE = "api.md"
# (source in the repository, where the site serves it)
OUTSIDE = [("CHANGELOG.md", "changelog.md"), ("benchmarks/README.md", "benchmarks/index.md")]
RESULTS = ROOT / "benchmarks" / "results"
RESULT_SUFFIXES = {".md", ".png", ".svg"}

_HELP = re.compile(r"<!-- autosplit-help:\s*(?P<args>[\w -]*?)\s*-->")
_MODULES = "<!-- autosplit-modules -->"
_LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?P<anchor>#[^)\s]*)?\)")
_DIRECTIVE = re.compile(r"^:::\s*autosplit\.(?P<name>\w+)\s*$", re.MULTILINE)
_EXAMPLE = re.compile(r"^([ \t]*)Example:$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|meth|class|attr|mod|data|exc):`~?([^`]+)`")


def on_files(files, config):
    for source, uri in _outside_sources():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files


def _outside_sources():
    yield from OUTSIDE
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in RESULT_SUFFIXES:
            yield f"benchmarks/results/{path.name}", f"benchmarks/results/{path.name}"


def on_page_markdown(markdown, page, config, files):
    markdown = _served_links(markdown, page.file.src_uri)
    markdown = _HELP.sub(lambda match: _help(match["args"].split()), markdown)
    if _MODULES in markdown:
        markdown = markdown.replace(_MODULES, _module_table())
    if page.file.src_uri == API_PAGE:
        _check_api(markdown)
    return markdown


def _served_links(markdown: str, page_uri: str) -> str:
    """``../benchmarks/README.md`` (the repository's file) -> ``benchmarks/index.md``."""
    served = dict(_outside_sources())
    here = posixpath.dirname(page_uri)
    # A served file's links are relative to where it lives in the repository.
    source = {uri: source for source, uri in served.items()}.get(page_uri)
    base = posixpath.dirname(source) if source else posixpath.join("docs", here)

    def point(match):
        target = posixpath.normpath(posixpath.join(base, match["target"]))
        if target not in served:
            return match[0]
        new = posixpath.relpath(served[target], here or ".")
        return f"]({new}{match['anchor'] or ''})"

    return _LINK.sub(point, markdown)


def _help(args: list[str]) -> str:
    env = dict(os.environ, COLUMNS="88", NO_COLOR="1", PYTHON_COLORS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "autosplit", *args, "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        log.warning("`autosplit %s --help` failed (exit %d): %s", " ".join(args),
                    done.returncode, done.stderr.strip())
    return f"```text\n{done.stdout.rstrip()}\n```"


def _docstring(path: Path) -> str:
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(text.split("\n\n")[0].split())


def _module_table() -> str:
    rows = ["| module | what it owns |", "|---|---|"]
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.name == "__main__.py" or relative == Path("__init__.py"):
            continue
        # A subpackage's row (its __init__ docstring) comes before its modules' rows.
        name = f"{relative.parent}/" if relative.name == "__init__.py" else relative.as_posix()
        rows.append(f"| `{name}` | {_docstring(path).replace('|', '&#124;')} |")
    return "\n".join(rows)


def exported_names() -> list[str]:
    """``autosplit.__all__``, read from the source, without importing the package."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__"
                for target in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("autosplit/__init__.py defines no __all__")


def _check_api(markdown: str) -> None:
    documented = set(_DIRECTIVE.findall(markdown))
    exported = set(exported_names()) - {"__version__"}
    for name in sorted(exported - documented):
        log.warning("%s: `autosplit.%s` is in autosplit.__all__ but not documented; "
                    "add `::: autosplit.%s`", API_PAGE, name, name)
    for name in sorted(documented - exported):
        log.warning("%s: `autosplit.%s` is documented but not in autosplit.__all__",
                    API_PAGE, name)


class HouseDocstrings(griffe.Extension):
    """``Example:`` read as ``Examples:`` (code, doctest flags trimmed); roles as code."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"``\1``", text)

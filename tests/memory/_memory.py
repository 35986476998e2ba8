"""What the memory tests share: units, the package's parent folder (for their children), fake
procfs and cgroup trees."""

from __future__ import annotations

from pathlib import Path

from autosplit.memory import device

KiB, MiB, GiB = 2**10, 2**20, 2**30


# The children import the same autosplit as this process.
PACKAGE_PARENT = Path(device.__file__).absolute().parents[1]


def _write_tree(root: Path, files: dict[str, str | int]) -> None:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{content}\n")

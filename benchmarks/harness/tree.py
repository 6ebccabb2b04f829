"""The source tree a benchmark measures: this checkout by default, another
one for the A/B runner (the ab scenario)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]  # the checkout these benchmarks belong to


@dataclass(frozen=True)
class Tree:
    """A django-pgqueue checkout and the Python that runs its testproject."""

    root: Path
    python: Path

    @classmethod
    def here(cls) -> Tree:
        """This checkout, with the interpreter running the benchmark."""
        return cls(HERE, Path(sys.executable))

    @classmethod
    def at(cls, root: str | Path, python: str | Path | None = None) -> Tree:
        """The checkout at ``root``, run by ``python`` (default: its ``.venv``)."""
        root = Path(root).resolve()
        return cls(root, Path(python) if python else root / ".venv" / "bin" / "python")

    @classmethod
    def named(cls, root: str | None) -> Tree:
        """A tree given on the command line: "." (or none) is this checkout,
        run by the benchmark's own interpreter; any other, ``at(root)``."""
        return cls.here() if root in (None, ".") else cls.at(root)

    @property
    def testproject(self) -> Path:
        return self.root / "testproject"

    def manage(self, *args: str) -> list[str]:
        """``manage.py`` with ``args``, to run with ``cwd=self.testproject``."""
        return [str(self.python), "manage.py", *args]

    def env(self, base: dict[str, str], *extra_paths: Path) -> dict[str, str]:
        """``base`` with this tree's package and testproject first on the path,
        whatever the interpreter's site-packages hold."""
        paths = [*map(str, extra_paths), str(self.root), str(self.testproject)]
        if base.get("PYTHONPATH"):
            paths.append(base["PYTHONPATH"])
        return {**base, "PYTHONPATH": os.pathsep.join(paths)}

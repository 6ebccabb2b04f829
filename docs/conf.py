"""Sphinx configuration of the django-pgqueue documentation.

Build: ``sphinx-build -W --keep-going -b html docs <out>`` (``tox -e docs``).
The Reference section is generated from the code by the extension in
``_ext/pgqueue_docs.py``; autodoc imports the package, so Django is set up
here with the test project's settings. No database is needed (nothing is
queried) and nothing is fetched from the network.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject"), str(DOCS / "_ext")]

# testproject/settings.py reads these; harmless values, never connected to:
# building the docs opens no database connection.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
os.environ.setdefault("DATABASE_URL", "postgres://docs@127.0.0.1:5432/docs")
os.environ.setdefault("OTHER_DATABASE_URL", "postgres://docs@127.0.0.1:5432/docs_other")
os.environ.setdefault("SECRET_KEY", "docs-build-only")

import django  # noqa: E402

django.setup()

import django_pgqueue  # noqa: E402

project = "django-pgqueue"
author = "The django-pgqueue authors"
copyright = "the django-pgqueue authors"  # noqa: A001  (Sphinx's name)
release = django_pgqueue.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "pgqueue_docs",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
highlight_language = "python"

# autodoc: signatures without annotations, each parameter's type listed
# below them (the docstrings say what the parameters mean in prose);
# members in source order, as the modules are written to be read.
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": False}

html_theme = "furo"
html_title = f"django-pgqueue {release}"
html_static_path: list[str] = []
html_theme_options = {
    "source_repository": "https://github.com/django-pgqueue/django-pgqueue/",
    "source_branch": "main",
    "source_directory": "docs/",
}

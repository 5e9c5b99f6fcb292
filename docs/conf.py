"""Sphinx configuration: `make docs` builds the site into docs/_build/html, warnings as errors.

The pages are the Markdown files beside this one (MyST); the notebooks are copied in from
``notebooks/`` and executed at build time (myst-nb), so the site shows their current outputs; the
API reference is generated from the docstrings (autodoc, Google style via napoleon).
"""

from __future__ import annotations

import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import masked_jax  # noqa: E402

project = "masked_jax"
author = "The masked_jax developers"
copyright = "2026, The masked_jax developers"
release = version = masked_jax.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "**.ipynb_checkpoints", "jupyter_execute"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

# The notebooks run at build time: the site shows what the current code prints and plots.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = f"masked_jax {release}"
html_theme_options = {"show_toc_level": 2}
suppress_warnings = ["mystnb.unknown_mime_type"]


def _copy_notebooks(app):
    """Bring ``notebooks/*.ipynb`` under the source tree (they are executed there, not in git)."""
    target = pathlib.Path(app.srcdir) / "notebooks"
    target.mkdir(exist_ok=True)
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        shutil.copyfile(nb, target / nb.name)
    shutil.copyfile(ROOT / "benchmarks" / "README.md", pathlib.Path(app.srcdir) / "benchmarks.md")


def setup(app):
    app.connect("builder-inited", _copy_notebooks)

"""Sphinx configuration: autodoc and napoleon for the API, MyST for the guides."""

import importlib
import pathlib
import sys

# Document the tree this file sits in, not an installed copy.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

project = "saggs-jax"
author = "saggs-jax contributors"
copyright = "2026, saggs-jax contributors"
release = version = importlib.import_module("saggs_jax").__version__

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
  "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"saggs-jax {release}"

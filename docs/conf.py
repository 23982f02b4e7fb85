"""Sphinx configuration: API pages from the docstrings (autodoc + autosummary), the
README's sections as guide pages (MyST includes), the tutorials executed (myst-nb).

Build with warnings as errors::

  sphinx-build -W --keep-going -b html docs docs/_build/html

The tutorials run in quick mode (``SR_TUTORIAL_QUICK=1``) unless the environment sets
``SR_TUTORIAL_QUICK=0``, which runs them at full size (tens of minutes).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
from pathlib import Path

from sphinx.util.inspect import safe_getattr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the package as checked out, installed or not

import statefulremat  # noqa: E402
from statefulremat.core._bookkeeping import DEFINED_IN  # noqa: E402

project = "statefulremat"
author = "the statefulremat authors"
copyright = "the statefulremat authors, Apache-2.0"
release = version = statefulremat.__version__

extensions = [
  "myst_nb",  # also registers myst_parser for the .md pages
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",  # the docstrings' Args: / Returns: sections (Google style)
  "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "conf.py", "**/__pycache__", "**/.ipynb_checkpoints"]
templates_path = ["_templates"]

# -- API pages ---------------------------------------------------------------------
# One page per public name, generated at build time into _autosummary/ (git-ignored).
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # `lengths="auto"`, not a repr of a sentinel
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The docstrings write ``code`` and `names`; a single-backquoted name reads as code.
default_role = "code"

# -- MyST pages and notebooks ------------------------------------------------------
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
# The tutorials are jupytext percent scripts in tutorials/ (docs/tutorials links there):
# one source, run by tests/test_tutorials.py as scripts and executed here as notebooks.
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "force"
nb_execution_raise_on_error = True  # a failing cell fails the build
nb_execution_timeout = 600  # seconds per cell: one running longer is stuck
nb_execution_in_temp = True  # files a tutorial writes land in a temporary folder
nb_merge_streams = True

os.environ.setdefault("SR_TUTORIAL_QUICK", "1")

# The kernels run the tutorials under the test suite's warning policy (pyproject.toml's
# filterwarnings: a warning is an error, but for its exceptions), as
# tests/test_tutorials.py runs them: an IPython startup file, in a profile of the
# build's own. The kernel's own machinery (ipykernel warns at shutdown) is not the
# tutorial's code.
_KERNEL_STARTUP = f"""\
import sys, warnings
sys.path.insert(0, {str(ROOT / "tests")!r})
import _warning_policy
_warning_policy.apply()
warnings.filterwarnings("ignore", module="ipykernel.*")
"""
_ipython_dir = Path(tempfile.mkdtemp(prefix="sr_docs_ipython_"))
(_ipython_dir / "profile_default" / "startup").mkdir(parents=True)
(_ipython_dir / "profile_default" / "startup" / "00_warnings.py").write_text(_KERNEL_STARTUP)
os.environ["IPYTHONDIR"] = str(_ipython_dir)

# -- HTML ----------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"statefulremat {release}"
html_theme_options = {
  "show_toc_level": 2,
}

_HEADING = re.compile(r"^(#{2,6}) ", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _promote_headings(text: str) -> str:
  """``## Title`` -> ``# Title`` (and ``###`` -> ``##``) outside code fences."""
  out, last = [], 0
  for fence in _FENCE.finditer(text):
    out.append(_HEADING.sub(lambda m: m.group(1)[1:] + " ", text[last : fence.start()]))
    out.append(fence.group(0))
    last = fence.end()
  out.append(_HEADING.sub(lambda m: m.group(1)[1:] + " ", text[last:]))
  return "".join(out)


def _readme_sections_as_pages(app, relative_path, parent_docname, content):
  # A guide page is one README section ("## X" with "### Y" inside): its headings move
  # up a level so that the section's title is the page's title.
  if Path(relative_path).name == "README.md":
    content[0] = _promote_headings(content[0])


# A public class names its public module (``sr.State.__module__ == "statefulremat"``, for
# pickles), whose file does not define it: autodoc reads the class's source (its members'
# order, its canonical name) and viewcode links it from the file that does.
def _defined_in(value) -> str | None:
  return vars(value).get(DEFINED_IN) if isinstance(value, type) else None


def _class_attribute(cls: type, name: str, *default):
  if name == "__module__" and _defined_in(cls):
    return _defined_in(cls)
  return safe_getattr(cls, name, *default)


def _source_module(app, modname: str, fullname: str) -> str | None:
  if "." in fullname:  # a method: its function names its file
    return None
  return _defined_in(getattr(importlib.import_module(modname), fullname, None))


def setup(app):
  app.connect("include-read", _readme_sections_as_pages)
  app.add_autodoc_attrgetter(type, _class_attribute)
  app.connect("viewcode-follow-imported", _source_module)

"""Sphinx configuration: the landing, installation and getting-started pages, the guides
(docs/guide/), the tutorials executed (myst-nb), API pages from the docstrings (autodoc +
autosummary), the benchmarks page (written from benchmarks/results/ at each build), the
changelog and a glossary.

Build with warnings as errors::

  sphinx-build -W --keep-going -b html docs docs/_build/html

The tutorials run in quick mode (``SR_TUTORIAL_QUICK=1``) unless the environment sets
``SR_TUTORIAL_QUICK=0``, which runs them at full size (tens of minutes). Their executed
notebooks are cached (myst-nb's ``cache`` mode) under ``docs/_build/.jupyter_cache/``, one
folder per state of the library, its pinned dependencies and the quick mode: a rebuild
with the same sources reuses them, a change to any of them executes the tutorials again.
``SR_DOCS_JUPYTER_CACHE=DIR`` puts the cache elsewhere (tests/test_docs.py gives each test
run a fresh one).

Links into the jax, flax, optax, orbax, treescope and Python docs (intersphinx) need their
inventories from the network: ``SR_DOCS_INTERSPHINX=1`` turns them on (the published
site's build). Without it the build reads nothing from the network, and those names show
as code without a link.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import shutil
import sys
import tempfile
import typing
from pathlib import Path

from sphinx.ext.autosummary import Autosummary, import_by_name, mangle_signature
from sphinx.util.inspect import safe_getattr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the package as checked out, installed or not

import statefulremat  # noqa: E402
from benchmarks import docs_page  # noqa: E402
from docs._signatures import public_path, readable_default  # noqa: E402
from statefulremat.core._bookkeeping import DEFINED_IN  # noqa: E402

project = "statefulremat"
author = "the statefulremat authors"
copyright = "the statefulremat authors, Apache-2.0"
release = version = statefulremat.__version__

extensions = [
  "myst_nb",  # also registers myst_parser for the .md pages
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.intersphinx",
  "sphinx.ext.napoleon",  # the docstrings' Args: / Returns: sections (Google style)
  "sphinx.ext.viewcode",
]

# "*.py": this folder's own scripts (conf.py, helpers), not notebooks; tutorials/*.py are.
exclude_patterns = ["_build", "*.py", "**/__pycache__", "**/.ipynb_checkpoints"]

# -- Links to the ecosystem's docs ---------------------------------------------------
# Off unless asked for: fetching an inventory offline is a warning, and -W fails on it.
intersphinx_mapping = {}
if os.environ.get("SR_DOCS_INTERSPHINX") == "1":
  intersphinx_mapping = {
    "python": ("https://docs.python.org/3/", None),
    "jax": ("https://docs.jax.dev/en/latest/", None),
    "flax": ("https://flax.readthedocs.io/en/latest/", None),
    "optax": ("https://optax.readthedocs.io/en/latest/", None),
    "orbax": ("https://orbax.readthedocs.io/en/latest/", None),
    "treescope": ("https://treescope.readthedocs.io/en/stable/", None),
  }
intersphinx_timeout = 10
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
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# The tutorials are jupytext percent scripts in tutorials/ (docs/tutorials links there):
# one source, executed here as notebooks (tests/test_docs.py checks each one's run).
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "cache"
nb_execution_raise_on_error = True  # a failing cell fails the build
nb_execution_show_tb = True  # and the log shows its traceback
nb_execution_timeout = 600  # seconds per cell: one running longer is stuck
nb_execution_in_temp = True  # files a tutorial writes land in a temporary folder
nb_merge_streams = True

os.environ.setdefault("SR_TUTORIAL_QUICK", "1")


def _cache_key() -> str:
  """What the tutorials' outputs depend on besides their own text (which jupyter-cache
  hashes): the library's source, the dependencies' versions, the quick mode."""
  digest = hashlib.sha256(os.environ["SR_TUTORIAL_QUICK"].encode())
  sources = sorted((ROOT / "statefulremat").rglob("*.py"))
  sources += [ROOT / "pyproject.toml", ROOT / "tests" / "_warning_policy.py"]
  for path in sources:
    digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
  from importlib.metadata import version

  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "treescope", "numpy"):
    digest.update(f"{package}=={version(package)}".encode())
  return digest.hexdigest()[:16]


def _execution_cache() -> str:
  if os.environ.get("SR_DOCS_JUPYTER_CACHE"):
    return os.environ["SR_DOCS_JUPYTER_CACHE"]
  caches = ROOT / "docs" / "_build" / ".jupyter_cache"  # git-ignored with docs/_build/
  here = caches / _cache_key()
  if caches.is_dir():  # an older state's outputs are never read again
    for old in caches.iterdir():
      if old != here and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
  return str(here)


nb_execution_cache_path = _execution_cache()

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
# No repository, issues or source buttons: the project has no public home yet, and a
# button to a host that does not exist leads nowhere. The download button gives each
# page's source. The sidebar opens only the current page's branch: the whole tree on
# each of ~180 pages was half the build's time (a site the size of the API reference).
html_theme_options = {"show_toc_level": 2, "collapse_navbar": True}


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


def _write_benchmarks_page(app):
  # docs/benchmarks.md is generated (git-ignored), from the committed results; written
  # only when its text changes, so an unchanged rebuild reads it again not at all.
  docs_page.write(ROOT / "docs" / "benchmarks.md")


def _readable_signature(app, what, name, obj, options, signature, return_annotation):
  # Defaults and return types as users write them (docs/_signatures.py says why).
  fn = obj.__init__ if isinstance(obj, type) else obj
  namespace = getattr(inspect.unwrap(fn), "__globals__", {})
  public = {n for n in vars(statefulremat) if not n.startswith("_")}
  if signature:
    signature = public_path(readable_default(signature, namespace), public)
  if return_annotation:
    return_annotation = public_path(return_annotation, public)
  return signature, return_annotation


def _overloaded(obj) -> bool:
  fn = obj.__init__ if isinstance(obj, type) else obj
  try:
    return bool(typing.get_overloads(inspect.unwrap(fn)))
  except (AttributeError, TypeError):
    return False


def _table_signature(obj, display_name: str) -> str:
  """The implementation's signature (the one users call), compacted as autosummary
  compacts every row: names only, optional ones in brackets."""
  sig = inspect.signature(obj)
  bare = [
    p.replace(annotation=p.empty, default=p.empty if p.default is p.empty else None)
    for p in sig.parameters.values()
  ]
  text = str(sig.replace(parameters=bare, return_annotation=sig.empty))
  return mangle_signature(text, max_chars=max(10, 50 - len(display_name)))


class _OneSignatureAutosummary(Autosummary):
  """autosummary, a row per name with the signature users call. For a function with
  @overload stubs Sphinx joins every stub's signature into one row, and its compaction
  garbles the join (``jit(, static_argnames, ...)``); such a row shows the
  implementation's signature instead, once."""

  def get_items(self, names):
    items = []
    for display_name, sig, summary, real_name in super().get_items(names):
      if sig:
        try:
          obj = import_by_name(real_name)[1]
        except ImportError:
          obj = None
        if obj is not None and _overloaded(obj):
          sig = _table_signature(obj, display_name)
      items.append((display_name, sig, summary, real_name))
    return items


def _implementation_signatures(app, config):
  # A transform's @overload stubs are for type checkers (a class in, its class out; they
  # spell the keywords once, as a TypedDict): its page shows the signature users call,
  # the implementation's, as its table row does, and the Args say the rest.
  from sphinx.pycode import ModuleAnalyzer

  analyze = ModuleAnalyzer.analyze

  def without_overloads(self):
    analyze(self)
    self.overloads = {}

  ModuleAnalyzer.analyze = without_overloads


def setup(app):
  app.connect("builder-inited", _write_benchmarks_page)
  app.connect("config-inited", _implementation_signatures)
  app.connect("autodoc-process-signature", _readable_signature)
  app.add_autodoc_attrgetter(type, _class_attribute)
  app.connect("viewcode-follow-imported", _source_module)
  app.add_directive("autosummary", _OneSignatureAutosummary, override=True)

"""The docs site builds with warnings as errors (``sphinx-build -W``), once per test
session: every public name has its API page, sr.remat_scan's shows its signature and
docstring (and draws in a real headless Chromium), and the tutorials are executed
notebooks whose outputs, treescope's included, are on their pages.

This build is where the test suite executes the tutorials, once each, into a notebook
cache of its own (never the developer's docs/_build/.jupyter_cache, whose outputs may
predate the library's current state): test_tutorial_runs reports each tutorial's
failure with its traceback. Without the docs tools (outside CI), it runs each tutorial
as a script instead, as a reader would."""

from __future__ import annotations

import fcntl
import html.parser
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import statefulremat as sr
from tests._browser import WIDTH, start_browser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))
BUILD_TIMEOUT = 1800  # seconds; the build takes about 11 minutes on 2 busy cores
SCREENSHOT_COPY = Path("/tmp/docs_remat_scan.png")


def missing_docs_tools() -> list[str]:
  needed = ("sphinx", "myst_nb", "jupytext", "sphinx_book_theme", "ipykernel")
  return [m for m in needed if importlib.util.find_spec(m) is None]


def require_docs_tools():
  missing = missing_docs_tools()
  if not missing:
    return
  what = ", ".join(missing)
  if os.environ.get("CI") == "true":
    pytest.fail(f"CI=true, but missing {what}: pip install -e '.[dev]' installs them.")
  pytest.skip(f"the docs build needs {what} (pip install -e '.[docs]')")


def _shared_dir(tmp_path_factory) -> Path:
  # pytest-xdist's workers share one run id and one temp root: one build for all of
  # them. Without xdist, this session's own temp folder.
  run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  if run_id:
    return tmp_path_factory.getbasetemp().parent / f"docs-{run_id}"
  return tmp_path_factory.getbasetemp() / "docs"


def _xla_flags() -> str:
  # The suite's 8 simulated devices (tests/conftest.py) are not passed on: tutorials
  # that need them set them up themselves, as for a reader.
  return re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
  ).strip()


def _build(out: Path) -> dict:
  env = dict(
    os.environ,
    SR_TUTORIAL_QUICK="1",
    XLA_FLAGS=_xla_flags(),
    SR_DOCS_JUPYTER_CACHE=str(out / "jupyter_cache"),  # this run's: every tutorial runs
  )
  env.pop("SR_DOCS_INTERSPHINX", None)  # no network here
  command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html"]
  # A failing tutorial fails the build (-W) but not the others' execution: each one's
  # traceback lands in html/reports/tutorials/<name>.err.log for test_tutorial_runs.
  command += ["-D", "nb_execution_raise_on_error=0"]
  command += ["-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
  result = subprocess.run(
    command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT
  )
  return {"returncode": result.returncode, "log": result.stdout + result.stderr}


@pytest.fixture(scope="session")
def build(tmp_path_factory) -> dict:
  """The build's result (``returncode``, ``log``, ``html``); it ran once, whichever
  worker came first."""
  require_docs_tools()
  shared = _shared_dir(tmp_path_factory)
  shared.mkdir(parents=True, exist_ok=True)
  marker = shared / "result.json"
  with open(shared / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here for the build
    try:
      if not marker.exists():
        shutil.rmtree(shared / "out", ignore_errors=True)
        marker.write_text(json.dumps(_build(shared / "out")))
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return dict(json.loads(marker.read_text()), html=shared / "out" / "html")


@pytest.fixture(scope="session")
def site(build) -> Path:
  """The built site's html folder, the build having passed with warnings as errors."""
  problems = [
    line
    for line in build["log"].splitlines()
    if re.search(r"WARNING|ERROR|Error|Traceback", line) and "IPKernelApp" not in line
  ]
  shown = "\n".join(problems[-60:] or build["log"].splitlines()[-60:])
  assert build["returncode"] == 0, f"sphinx-build -W failed ({build['returncode']}):\n{shown}"
  return build["html"]


class _Text(html.parser.HTMLParser):
  """A page's visible text: no scripts, styles or templates."""

  def __init__(self):
    super().__init__()
    self.parts: list[str] = []
    self._skip = 0

  def handle_starttag(self, tag, attrs):
    if tag in ("script", "style", "template"):
      self._skip += 1

  def handle_endtag(self, tag):
    if tag in ("script", "style", "template") and self._skip:
      self._skip -= 1

  def handle_data(self, data):
    if not self._skip:
      self.parts.append(data)


def page_text(path: Path) -> str:
  parser = _Text()
  parser.feed(path.read_text(encoding="utf-8"))
  return " ".join(" ".join(parser.parts).split())


def squeezed(text: str) -> str:
  """Text without whitespace: the page spaces inline markup differently."""
  return "".join(text.replace("``", "").split())


def public_names() -> dict[str, object]:
  """Every public name the package exports, by its documented full name."""
  names = {}
  for module, prefix in ((sr, "statefulremat"), (sr.nn, "statefulremat.nn")):
    for name, obj in vars(module).items():
      if not name.startswith("_") and not inspect.ismodule(obj):
        names[f"{prefix}.{name}"] = obj
  names["statefulremat.nn.initializers"] = sr.nn.initializers
  for name in sr.interop.__all__:
    names[f"statefulremat.interop.{name}"] = getattr(sr.interop, name)
  # sr.policies' own functions and class; its presets and JAX's re-exported policies are
  # listed on its page (docs/api/policies.rst).
  for name in ("preset", "custom", "Policy"):
    names[f"statefulremat.policies.{name}"] = getattr(sr.policies, name)
  return names


def test_the_site_builds_with_warnings_as_errors(site):
  assert (site / "index.html").is_file()
  # The README's sections are its guide pages, single-sourced.
  for page, heading in (("which_remat", "Which remat?"), ("deep_stacks", "Deep stacks")):
    assert heading in page_text(site / "guide" / f"{page}.html"), page


def test_the_site_opens_with_install_a_first_model_and_the_way_in(site):
  landing = page_text(site / "index.html")
  for text in ("activation checkpointing", "sr.remat_scan(Block", "train_step"):
    assert text in landing, text
  assert "pip install" in page_text(site / "installation.html")
  assert "jax[cuda12]" in page_text(site / "installation.html")
  getting_started = page_text(site / "getting_started.html")
  assert "sr.remat_scan(Block" in getting_started and "Line by line" in getting_started
  assert "Unreleased" in page_text(site / "changelog.html")  # CHANGELOG.md, included
  glossary = (site / "glossary.html").read_text(encoding="utf-8")
  for term in ("remat", "activation checkpointing", "layer axis", "carry", "broadcast"):
    assert f'id="term-{term.replace(" ", "-")}"' in glossary, term
  # No button or link to a home the project does not have (a repository, a hosted site).
  index = (site / "index.html").read_text(encoding="utf-8")
  assert "github.com/" + "statefulremat" not in index, "a link to a repository that does not exist"
  assert "statefulremat" + ".readthedocs.io" not in index
  # The guides link the API pages of the names they use.
  deep_stacks = (site / "guide" / "deep_stacks.html").read_text(encoding="utf-8")
  assert "_autosummary/statefulremat.remat_scan.html" in deep_stacks


def test_the_benchmarks_page_is_written_from_the_results(site):
  from benchmarks import docs_page

  text = page_text(site / "benchmarks.html")
  assert "At a glance" in text and "statefulremat meets" in text
  # Each committed report is on the page, under its own heading.
  for stem, _ in docs_page.PARTS:
    report = ROOT / "benchmarks" / "results" / f"{stem}.md"
    title = report.read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
    assert squeezed(title) in squeezed(text), stem


def test_every_public_name_has_a_page(site):
  pages = {p.stem for p in (site / "_autosummary").glob("*.html")}
  names = public_names()
  missing = []
  for full, obj in names.items():
    # A name exported twice (sr.Sequential is sr.nn.Sequential) has one page.
    aliases = [other for other, o in names.items() if o is obj]
    if not any(alias in pages for alias in aliases):
      missing.append(full)
  assert not missing, f"no API page for {missing}: add them to a group in docs/api/*.rst"
  initializers = (site / "_autosummary" / "statefulremat.nn.initializers.html").read_text()
  for name in dir(sr.nn.initializers):
    obj = getattr(sr.nn.initializers, name)
    if not name.startswith("_") and callable(obj) and name != "Callable":
      assert f'id="statefulremat.nn.initializers.{name}"' in initializers, name


def test_the_remat_scan_page_shows_its_signature_and_docstring(site):
  page = site / "_autosummary" / "statefulremat.remat_scan.html"
  source = page.read_text(encoding="utf-8")
  signature = re.search(
    r'<dt class="sig[^"]*" id="statefulremat.remat_scan">(.*?)</dt>', source, re.S
  )
  assert signature, "no signature for statefulremat.remat_scan"
  shown = " ".join(re.sub(r"<[^>]+>", "", signature.group(1)).split())
  for argument in ("lengths", "memory_budget"):
    assert argument in shown, shown
  text = page_text(page)
  doc = inspect.getdoc(sr.remat_scan)
  assert squeezed(doc.splitlines()[0]) in squeezed(text)
  assert ">>> " in text  # its doctest example


def test_api_pages_show_no_raw_markup(site):
  # reST takes ``None``s or `` / `` as text without a warning: the page shows the quotes.
  broken = {}
  for page in sorted((site / "_autosummary").glob("*.html")):
    text = page_text(page)
    if "``" in text:
      at = text.index("``")
      broken[page.stem] = text[max(0, at - 60) : at + 40]
  assert not broken, f"docstrings whose ``literals`` do not render: {broken}"


def autosummary_rows(page: Path) -> list[tuple[str, str]]:
  """``(full name, signature shown)`` for each row of the page's autosummary tables."""
  rows = []
  source = page.read_text(encoding="utf-8")
  for table in re.findall(r'<table class="autosummary.*?</table>', source, re.S):
    for cell in re.findall(r"<tr[^>]*>\s*<td>(.*?)</td>", table, re.S):
      link = re.search(r'title="([^"]+)"[^>]*>(.*?)</a>(.*)', cell, re.S)
      assert link, f"{page.name}: a row without a link: {cell[:200]}"
      shown = html.unescape(" ".join(re.sub(r"<[^>]+>", "", link.group(3)).split()))
      rows.append((link.group(1), shown))
  return rows


def resolve(full_name: str) -> object:
  """The object a documented full name (``statefulremat.nn.Linear``) names."""
  parts = full_name.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    for part in parts[cut:]:
      obj = getattr(obj, part)
    return obj
  raise ImportError(full_name)


def test_api_tables_show_the_signature_users_call_once(site):
  # A function with @overload stubs once showed them joined and garbled
  # (`jit(, static_argnames, donate_state, ...)`): each row is one signature, compacted
  # as autosummary does (optional names in brackets, `...` past the width), whose names
  # are the real parameters, in order, each once.
  checked, broken = 0, {}
  for page in sorted((site / "api").glob("*.html")):
    for full_name, shown in autosummary_rows(page):
      if not shown:
        continue  # no signature to show (an alias of a jax function, a module)
      names = re.findall(r"[A-Za-z_]\w*", shown)
      try:
        real = list(inspect.signature(resolve(full_name)).parameters)
      except (TypeError, ValueError):
        real = None
      it = iter(real or ())
      problem = None
      if re.match(r"\(\s*,", shown):
        problem = "starts with `(,`"
      elif len(set(names)) != len(names):
        problem = "a parameter shown twice"
      elif real is not None and not all(name in it for name in names):
        problem = f"not the parameters {real}, in order"
      if problem:
        broken[full_name] = f"{shown}: {problem}"
      checked += 1
  assert checked > 100, f"only {checked} rows with a signature: are the tables still read?"
  assert not broken, f"API tables show signatures users do not call: {broken}"


# Runs a tutorial under the suite's warning policy (pyproject.toml's filterwarnings:
# warnings are errors, but for its exceptions; tests/_warning_policy.py reads them).
SCRIPT_RUNNER = f"""\
import runpy, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import _warning_policy
_warning_policy.apply()
runpy.run_path(sys.argv[1], run_name="__main__")
"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_as_script(path: Path, tmp_path: Path):
  python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  env = dict(
    os.environ,
    SR_TUTORIAL_QUICK="1",
    SR_TUTORIAL_OUT=str(tmp_path / "out"),
    MPLBACKEND="Agg",
    XLA_FLAGS=_xla_flags(),
    PYTHONPATH=python_path,
  )
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT_RUNNER, str(path)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, (
    f"{path.name} exited with {result.returncode}; stdout ends:\n"
    + "\n".join(result.stdout.splitlines()[-10:])
    + "\nstderr ends:\n"
    + "\n".join(result.stderr.splitlines()[-40:])
  )


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(tutorial, request, tmp_path):
  """Each tutorial's run: its cells executed by the docs build (once per test run), or
  the tutorial run as a script: without the docs tools outside CI, and in the lanes that
  build no docs (``SR_TUTORIALS_AS_SCRIPTS=1``, .ci/newest)."""
  as_scripts = os.environ.get("SR_TUTORIALS_AS_SCRIPTS") == "1"
  if as_scripts or (missing_docs_tools() and os.environ.get("CI") != "true"):
    run_as_script(tutorial, tmp_path)
    return
  html = request.getfixturevalue("build")["html"]
  report = html / "reports" / "tutorials" / f"{tutorial.stem}.err.log"
  if report.is_file():
    traceback = ANSI.sub("", report.read_text(encoding="utf-8"))
    pytest.fail(f"{tutorial.name} failed in the docs build:\n{traceback[-6000:]}")
  page = html / "tutorials" / f"{tutorial.stem}.html"
  assert page.is_file(), f"{tutorial.name}: no page (the build log says why)"
  assert "cell_output" in page.read_text(encoding="utf-8"), (
    f"{tutorial.name}: no executed output on its page"
  )


def test_treescope_outputs_are_kept(site):
  # sr.display in a notebook: treescope's foldable HTML, with the script that draws it.
  treescope = (site / "tutorials" / "05_treescope_inspection.html").read_text(encoding="utf-8")
  assert "<treescope-container" in treescope and "<script" in treescope


@pytest.fixture
def driver():
  browser = start_browser()
  try:
    yield browser
  finally:
    browser.quit()


def test_the_remat_scan_page_in_a_browser(site, driver, tmp_path):
  from PIL import Image
  from selenium.webdriver.common.by import By

  driver.get((site / "_autosummary" / "statefulremat.remat_scan.html").as_uri())
  signature = driver.find_element(By.ID, "statefulremat.remat_scan")
  assert signature.is_displayed() and signature.size["width"] > 0
  for text in ("remat_scan", "lengths", "memory_budget"):
    assert text in signature.text, signature.text
  assert "remat_scan" in driver.title

  png = tmp_path / "remat_scan.png"
  assert driver.save_screenshot(str(png))
  shutil.copyfile(png, SCREENSHOT_COPY)
  with Image.open(png) as image:
    pixels = image.convert("RGB")
    assert pixels.size[0] == WIDTH
    background = pixels.getpixel((pixels.size[0] - 1, pixels.size[1] - 1))
    colours = pixels.getcolors(maxcolors=1 << 24)
  drawn = sum(count for count, colour in colours if colour != background)
  # Text, the sidebar and the signature: a blank or unstyled page draws far less.
  assert drawn > 0.02 * WIDTH * pixels.size[1], (drawn, background)
  assert len(colours) > 50, "a styled page has anti-aliased text in several colours"

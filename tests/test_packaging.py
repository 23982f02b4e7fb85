"""What the package says about itself is true: one version, a licence file, typed, and
dependency floors that .ci/floors installs exactly and tests."""

import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import jax.extend.core
from packaging.version import Version

import statefulremat as sr
from statefulremat.core import _tracing

ROOT = pathlib.Path(__file__).parent.parent


def test_one_version_in_the_metadata_and_the_module():
  assert importlib.metadata.version("statefulremat") == sr.__version__


def test_the_licence_and_the_typed_marker_ship_with_the_package():
  meta = importlib.metadata.metadata("statefulremat")
  assert meta["License-Expression"] == "Apache-2.0"
  assert "Apache License" in (ROOT / "LICENSE").read_text()
  assert (pathlib.Path(sr.__file__).parent / "py.typed").exists()
  assert meta["Requires-Python"] == ">=3.11"


def _declared_floors() -> dict[str, str]:
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  floors = dict(re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9][A-Za-z0-9.]*)", d).groups() for d in deps)
  assert len(floors) == len(deps), f"every dependency needs one '>=' floor: {deps}"
  return floors


def test_the_floor_script_pins_exactly_the_floors_pyproject_declares():
  script = (ROOT / ".ci" / "floors").read_text()
  # The pins come from pyproject.toml, never from a second list in the script.
  assert not re.search(r"[A-Za-z]==[0-9]", script), "a version is pinned in .ci/floors itself"
  assert ".venv-floors" in script and "--clear" in script
  reader = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.S).group(1)
  out = subprocess.run(
    [sys.executable, "-c", reader], cwd=ROOT, capture_output=True, text=True, check=True
  )
  floors = _declared_floors()
  assert out.stdout.split() == [f"{name}=={v}" for name, v in floors.items()]
  assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "treescope", "numpy"} <= set(floors)


def test_ci_runs_every_supported_stack_after_the_main_tests_and_needs_them_all():
  run = (ROOT / ".ci" / "run").read_text()
  lanes = [
    'lane "main tests" bash -c \'pip install -e ".[dev]" && python -m pytest -n 2\'',
    "bash .ci/newest 3.12",
    "bash .ci/newest 3.13",
    "bash .ci/floors",
  ]
  places = [run.index(lane) for lane in lanes]
  assert places == sorted(places)
  assert '[ "$rc" -eq 0 ] || failed=1' in run and run.rstrip().endswith('[ "$failed" -eq 0 ]')


def _listed(name: str) -> list[str]:
  lines = (ROOT / ".ci" / name).read_text().splitlines()
  return [line for line in lines if line and not line.startswith("#")]


def test_the_lanes_test_lists_name_test_files_that_exist():
  assert _listed("smoke-tests")
  for path in _listed("smoke-tests"):
    assert (ROOT / path).is_file(), f".ci/smoke-tests names {path}, which does not exist"
  newest = (ROOT / ".ci" / "newest").read_text()
  assert "JAX_REMAT3=1" in newest and "remat3-tests" in newest
  assert "--ignore=tests/test_docs.py --ignore=tests/test_browser.py" in newest


# What a test file calls when it reads a policy, a plan or a residual; the files that only
# pass one through (a docstring, an import graph, a pickle, an error kind, and
# everything_saveable as "no remat" in a refusal's fix) are not remat tests.
READS_REMAT = re.compile(r"plan_remat|saved_residuals|sr\.policies|checkpoint_policies|policy=")
PASSES_THROUGH = {"test_docs", "test_docstrings", "test_layering", "test_pickle_stacks"}
PASSES_THROUGH |= {"test_error_kinds", "test_packaging", "test_pattern_errors"}


def test_the_remat3_lane_runs_every_file_that_reads_a_policy_a_plan_or_a_residual():
  globs = _listed("remat3-tests")
  lane = {path for glob in globs for path in ROOT.glob(glob)}
  assert lane, globs
  missed = [
    path.name
    for path in sorted((ROOT / "tests").glob("test_*.py"))
    if path not in lane and path.stem not in PASSES_THROUGH and READS_REMAT.search(path.read_text())
  ]
  assert not missed, (
    f"{missed} read a policy, a plan or a residual but .ci/remat3-tests does not run "
    "them under JAX_REMAT3=1: move those tests into a file of the lane (by concept: "
    "test_remat_policy.py, test_remat_plan.py), or widen a glob."
  )


def test_the_classifiers_name_each_python_a_lane_tests():
  meta = importlib.metadata.metadata("statefulremat")
  tested = {"3.11", "3.12", "3.13"}  # main and floors on 3.11; .ci/newest 3.12 and 3.13
  classified = {
    c.rsplit(" :: ", 1)[1]
    for c in meta.get_all("Classifier") or []
    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
  }
  assert classified == tested


def test_the_installed_dependencies_meet_the_declared_floors():
  for name, floor in _declared_floors().items():
    installed = importlib.metadata.version(name)
    assert Version(installed) >= Version(floor), f"{name} {installed} is below its floor {floor}"


def test_the_trace_identity_comes_from_jax_extend_without_deprecation_warnings():
  assert _tracing.get_opaque_trace_state is jax.extend.core.get_opaque_trace_state
  # A fresh interpreter with every warning an error: jax.core's deprecated copy is not touched.
  subprocess.run(
    [sys.executable, "-W", "error", "-c", "import statefulremat"], cwd=ROOT, check=True
  )


# Homes the project does not have (yet): a link to one leads nowhere. Spelled in two parts
# so that this file does not name them.
NOWHERE = ("statefulremat" + ".readthedocs.io", "github.com/" + "statefulremat")
TEXT_SUFFIXES = {".md", ".rst", ".py", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".json", ".html"}


def _shipped_text_files() -> list[pathlib.Path]:
  """The README, the docs sources, pyproject.toml, the package, tutorials, examples and
  benchmarks: what a reader of a clone reads (not the built site, not the tests)."""
  files = [ROOT / name for name in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md")]
  files.append(ROOT / "pyproject.toml")
  for folder in ("docs", "statefulremat", "tutorials", "examples", "benchmarks", ".ci"):
    for path in sorted((ROOT / folder).rglob("*")):
      skipped = {"_build", "_autosummary", "__pycache__"} & set(path.parts)
      if path.is_file() and not skipped and (path.suffix in TEXT_SUFFIXES or folder == ".ci"):
        files.append(path)
  return [path for path in files if path.is_file()]


def test_no_file_links_a_home_the_project_does_not_have():
  found = {}
  for path in _shipped_text_files():
    text = path.read_text(encoding="utf-8", errors="replace")
    hosts = [host for host in NOWHERE if host in text]
    if hosts:
      found[str(path.relative_to(ROOT))] = hosts
  assert not found, f"links to sites that do not exist (link the files by path): {found}"
  urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {})
  assert all(url.startswith("https://") for url in urls.values()), urls

"""Every tutorial runs as a script in quick mode (fresh process, own output directory)
and is a jupytext percent-format file, so it also opens as a notebook."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))
HEADER = """\
# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---
"""
# Runs a tutorial under the suite's warning policy (pyproject.toml's filterwarnings:
# warnings are errors, but for its exceptions; tests/_warning_policy.py reads them).
RUNNER = f"""\
import runpy, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import _warning_policy
_warning_policy.apply()
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def test_there_are_tutorials():
  assert len(TUTORIALS) >= 6, [t.name for t in TUTORIALS]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_is_a_percent_format_notebook(path):
  text = path.read_text()
  assert text.startswith(HEADER), f"{path.name} lacks the jupytext header"
  cells = [line for line in text[len(HEADER) :].splitlines() if line.startswith("# %%")]
  assert cells and cells[0] == "# %% [markdown]", f"{path.name} should open with prose"
  assert any(line == "# %%" for line in cells), f"{path.name} has no code cell"


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs_in_quick_mode(path, tmp_path):
  # The suite's 8 simulated devices (tests/conftest.py) are not passed on: a tutorial
  # that needs them sets them up itself, as it would for a reader.
  xla_flags = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
  ).strip()
  python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  env = dict(
    os.environ,
    SR_TUTORIAL_QUICK="1",
    SR_TUTORIAL_OUT=str(tmp_path / "out"),
    MPLBACKEND="Agg",
    XLA_FLAGS=xla_flags,
    PYTHONPATH=python_path,
  )
  result = subprocess.run(
    [sys.executable, "-c", RUNNER, str(path)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, (
    f"{path.name} exited with {result.returncode}; stdout ends:\n"
    + "\n".join(result.stdout.splitlines()[-10:])
    + "\nstderr ends:\n"
    + "\n".join(result.stderr.splitlines()[-40:])
  )

"""Every tutorial is a jupytext percent-format file, so it also opens as a notebook. Its
run is tests/test_docs.py::test_tutorial_runs: once per test run, executed by the docs
build (or as a script where the docs tools are missing, outside CI)."""

import pathlib

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


def test_there_are_tutorials():
  assert len(TUTORIALS) >= 6, [t.name for t in TUTORIALS]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_is_a_percent_format_notebook(path):
  text = path.read_text()
  assert text.startswith(HEADER), f"{path.name} lacks the jupytext header"
  cells = [line for line in text[len(HEADER) :].splitlines() if line.startswith("# %%")]
  assert cells and cells[0] == "# %% [markdown]", f"{path.name} should open with prose"
  assert any(line == "# %%" for line in cells), f"{path.name} has no code cell"

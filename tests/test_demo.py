"""The demo (examples/demo.py) at small sizes: run as a script, it trains, compares
memory, writes a checkpoint that restores, a treescope page naming the layer axis and a
loss plot, and says where."""

import pathlib
import re
import runpy
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import statefulremat as sr

DEMO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def run_demo(monkeypatch, *args: str) -> int:
  """Runs the script as ``python examples/demo.py *args`` would, in this process (no
  second start of jax); returns its exit status."""
  monkeypatch.setattr(sys, "argv", [str(DEMO), *args])
  with pytest.raises(SystemExit) as info:
    runpy.run_path(str(DEMO), run_name="__main__")
  return info.value.code


@pytest.fixture(scope="module")
def demo():
  """The script's names (its classes and functions), loaded without running the demo."""
  return runpy.run_path(str(DEMO))


def test_demo_trains_compares_memory_and_writes_its_files(tmp_path, capsys, monkeypatch, demo):
  out = tmp_path / "out"
  args = ["--depth", "6", "--width", "8", "--steps", "30", "--batch", "32", "--out", str(out)]
  assert run_demo(monkeypatch, *args) == 0
  text = capsys.readouterr().out
  assert "6 residual blocks (BatchNorm, Dropout) of width 8 under remat_scan lengths=(2, 3)" in text
  memory = dict(re.findall(r"^  (scan|scan\(remat\)|remat_scan) +([\d.]+) MiB", text, re.MULTILINE))
  assert set(memory) == {"scan", "scan(remat)", "remat_scan"}
  first, last = map(float, re.search(r"training loss ([\d.]+) -> ([\d.]+)", text).groups())
  assert last < first
  for name in ("checkpoint", "stacked_state.html", "loss.png"):
    assert str(out / name) in text and (out / name).exists()

  # The checkpoint is the trained model: it restores into a fresh one.
  model = demo["ResidualMLP"](6, 8, rngs=sr.Rngs(params=9, dropout=9))
  sr.restore(out / "checkpoint", model)
  assert int(model.blocks.norm.mean.value.shape[0]) == 6
  assert not np.allclose(model.blocks.norm.mean.value, 0)  # trained batch statistics
  model.eval()
  assert model(jnp.zeros((2, 1))).shape == (2, 1)

  page = (out / "stacked_state.html").read_text(encoding="utf-8")
  assert "<script" in page
  # A heading says what the page shows, a sentence under it where it comes from.
  heading = "The 6 residual blocks of the demo, after 30 training steps"
  assert f"<title>{heading}</title>" in page and f"<h1>{heading}</h1>\n<p>The trained " in page
  assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_remat_scan_lengths_are_as_even_as_the_depth_allows(demo):
  lengths_for = demo["lengths_for"]
  assert lengths_for(100) == (10, 10)
  assert lengths_for(96) == (8, 12)
  assert lengths_for(7) == (7,)
  assert lengths_for(1) == (1,)


def test_help_explains_the_options(capsys, monkeypatch):
  assert run_demo(monkeypatch, "--help") == 0
  text = capsys.readouterr().out
  for option in ("--depth", "--width", "--steps", "--batch", "--seed", "--out", "--no-memory"):
    assert option in text
  assert "remat_scan" in text


def test_bad_sizes_are_refused(capsys, monkeypatch):
  assert run_demo(monkeypatch, "--depth", "0") == 2
  assert "--depth must be a positive integer, got 0" in capsys.readouterr().err

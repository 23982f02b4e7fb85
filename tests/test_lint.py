"""The house style is the formatter's: `ruff format --check` and `ruff check` pass."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
  exe = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
  return subprocess.run(
    [exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
  )


def test_code_is_formatted_by_ruff():
  done = _ruff("format", "--check", ".")
  assert done.returncode == 0, (
    f"ruff format would change files — run `ruff format .`:\n{done.stdout}{done.stderr}"
  )


def test_ruff_lint_is_clean():
  done = _ruff("check", ".")
  assert done.returncode == 0, f"`ruff check .` found:\n{done.stdout}{done.stderr}"


def test_the_config_records_the_house_style():
  import tomllib

  config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
  assert config["indent-width"] == 2 and config["line-length"] == 100

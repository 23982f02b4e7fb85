"""pyright (basic, as configured in pyproject.toml) is clean on the package, the tutorials,
the examples (examples/demo.py) and on user code that leans on the public signatures
(`sr.state(m, sr.Param).flat()`, `graphdef, params, rest = sr.split(m, sr.Param, ...)`);
in strict mode on a user's script (tests/typing/user_script.py: types survive the
transforms); and the main names have the types tests/typing/reveal_types.py says.

One pyright run checks them all (a run costs ~20 s of start-up and jax's stubs); each
test reads its own files' diagnostics from the JSON report.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
USER_SCRIPT = ROOT / "tests" / "typing" / "user_script.py"
REVEALS = ROOT / "tests" / "typing" / "reveal_types.py"

# What a user writes: every line must type-check with no error (and no warning).
USER_CODE = textwrap.dedent(
  """\
  from __future__ import annotations

  import jax
  import jax.numpy as jnp
  import statefulremat as sr

  model = sr.nn.BatchNorm(3, rngs=sr.Rngs(0))

  paths: list[tuple] = sorted(sr.state(model, sr.Param).flat())
  everything: sr.State = sr.state(model)
  params, stats = sr.state(model, sr.Param, sr.BatchStat)
  n: int = len(params.flat()) + len(stats.flat())

  graphdef, state = sr.split(model)
  graphdef, params, rest = sr.split(model, sr.Param, ...)
  graphdef, params, stats, rest = sr.split(model, sr.Param, sr.BatchStat, ...)
  keys = sorted(params.flat()) + sorted(rest.flat())
  copy = sr.merge(graphdef, params, stats, rest)
  again = sr.merge(*sr.split(model))

  sown: sr.State = sr.pop(model, sr.Intermediate)
  sown_paths = sown.flat()
  intermediates, caches = sr.pop(model, sr.Intermediate, sr.Cache)

  only: dict = sr.state(model).filter(sr.Param).flat()
  p, s = sr.state(model).filter(sr.Param, sr.BatchStat)
  stats_first, others = sr.state(model).split(sr.BatchStat, ...)

  w = sr.Param(jnp.ones(3))
  y = -w + w * 2 - abs(w)
  w += 1
  key: jax.Array = sr.Rngs(0).params()
  """
)


def _pyright_report(user_file: pathlib.Path) -> dict:
  # `--pythonpath` points pyright at the interpreter running the tests, so jax and flax
  # resolve from the active environment (no venv path is recorded in the config). The
  # project's [tool.pyright] settings apply; files named on the command line replace
  # its `include`, so the package, the tutorials and the examples are named here too.
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "pyright",
      "--outputjson",
      "--project",  # this checkout's pyproject.toml, never a pyrightconfig.json above it
      str(ROOT),
      "--pythonpath",
      sys.executable,
      "statefulremat",
      "tutorials",
      "examples",
      str(user_file),
      str(USER_SCRIPT),
      str(REVEALS),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  try:
    return json.loads(done.stdout)
  except json.JSONDecodeError:
    pytest.fail(f"pyright did not run (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
  user_file = tmp_path_factory.mktemp("user_code") / "user_code.py"
  user_file.write_text(USER_CODE)
  return {"report": _pyright_report(user_file), "user_file": str(user_file)}


def _lines(diagnostics: list[dict]) -> str:
  return "\n".join(
    f"{d['file']}:{d['range']['start']['line'] + 1}: {d['severity']}: {d['message']}"
    f" ({d.get('rule', '')})"
    for d in diagnostics
  )


def test_user_code_using_the_public_signatures_type_checks(report):
  found = [d for d in report["report"]["generalDiagnostics"] if d["file"] == report["user_file"]]
  assert not found, (
    f"pyright finds problems in user code that uses sr.state / sr.split / sr.pop:\n"
    f"{_lines(found)}\nthe code:\n{USER_CODE}"
  )


def test_pyright_is_clean_on_the_package_and_tutorials(report):
  ours = [
    d
    for d in report["report"]["generalDiagnostics"]
    if d["file"] != report["user_file"] and d["severity"] == "error"
  ]
  summary = report["report"]["summary"]
  assert not ours, (
    f"pyright (basic) finds {len(ours)} error(s) in statefulremat/, tutorials/ and examples/ "
    f"({summary['filesAnalyzed']} files); fix them (run `python -m pyright`):\n{_lines(ours)}"
  )
  assert summary["filesAnalyzed"] > 100  # the package and the tutorials were read


def _diagnostics(report: dict, path: pathlib.Path) -> list[dict]:
  return [d for d in report["report"]["generalDiagnostics"] if d["file"] == str(path)]


def test_user_script_passes_strict_mode(report):
  # `# pyright: strict` at its top: every type of the package it touches is known (the
  # stack from sr.remat_scan, its layers and kernels, sr.jit's and sr.value_and_grad's
  # results), so the script has no error and no warning.
  found = _diagnostics(report, USER_SCRIPT)
  assert not found, f"pyright (strict) finds problems in {USER_SCRIPT.name}:\n{_lines(found)}"


def test_revealed_types_of_the_main_names(report):
  lines = REVEALS.read_text().splitlines()
  expected = {
    i: line.split("  # -> ", 1)[1].strip()
    for i, line in enumerate(lines)
    if line.startswith("reveal_type(") and "  # -> " in line
  }
  assert len(expected) > 25
  found = _diagnostics(report, REVEALS)
  problems = [d for d in found if d["severity"] != "information"]
  assert not problems, _lines(problems)
  revealed = {}
  for d in found:
    match = re.fullmatch(r'Type of ".*" is "(.*)"', d["message"], re.S)
    if match:
      revealed[d["range"]["start"]["line"]] = match.group(1)
  wrong = [
    f"line {i + 1}: {lines[i].split('  # -> ')[0]}\n  expected {want}\n  pyright: "
    f"{revealed.get(i, '(nothing revealed)')}"
    for i, want in expected.items()
    if revealed.get(i) != want
  ]
  assert not wrong, "revealed types differ:\n" + "\n".join(wrong)

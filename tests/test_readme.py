"""The README's first example runs as written and trains."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def first_model_block() -> str:
  text = README.read_text(encoding="utf-8")
  section = text.split("## A first model", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_first_model_example_runs_and_learns(capsys):
  code = first_model_block()
  assert len([line for line in code.splitlines() if line.strip()]) <= 20
  namespace: dict = {}
  exec(compile(code, str(README), "exec"), namespace)
  losses, model = namespace["losses"], namespace["model"]
  assert losses[-1] < losses[0]
  assert model.linear.kernel.shape == (100, 16, 16)
  assert model.norm.use_running_average  # model.eval() reached every layer
  assert "loss " in capsys.readouterr().out


# The README is also the package's description (pyproject.toml's readme): it fits on a
# few screens, says the words users search for, and its links work off GitHub too.
QUICKSTART = [
  'pip install -e ".[demo]" && python examples/demo.py',
  'pip install -e ".[dev]" && python -m pytest -n 2',  # .ci/run runs this line
]


def test_the_readme_fits_on_a_few_screens():
  lines = README.read_text(encoding="utf-8").splitlines()
  assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"


def test_the_readme_says_activation_checkpointing():
  text = " ".join(README.read_text(encoding="utf-8").lower().split())
  assert "activation checkpointing" in text and "gradient checkpointing" in text


def test_the_readme_links_are_absolute():
  text = README.read_text(encoding="utf-8")
  targets = re.findall(r"\]\(([^)\s]+)", text)  # [text](target), ![alt](target)
  targets += re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.MULTILINE)  # [ref]: target
  targets += re.findall(r"""<(?:img|a)\s[^>]*(?:src|href)=["']([^"']+)""", text)
  relative = [t for t in targets if not t.startswith(("https://", "http://", "#"))]
  assert targets and not relative, f"relative links break on PyPI: {relative}"
  assert "DESIGN.md" not in text


def test_the_quickstart_is_exactly_two_commands():
  section = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1]
  block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
  assert [line for line in block.splitlines() if line.strip()] == QUICKSTART

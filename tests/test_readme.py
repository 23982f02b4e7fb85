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

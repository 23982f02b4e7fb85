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
# few screens, says the words users search for, and a reader of a clone reaches every
# page it links: the docs sources, guides and files by relative path (they render on any
# code host), never a site the project does not have.
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


def readme_links() -> list[str]:
  text = README.read_text(encoding="utf-8")
  targets = re.findall(r"\]\(([^)\s]+)", text)  # [text](target), ![alt](target)
  targets += re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.MULTILINE)  # [ref]: target
  targets += re.findall(r"""<(?:img|a)\s[^>]*(?:src|href)=["']([^"']+)""", text)
  targets += re.findall(r"<(https?://[^>\s]+)>", text)  # <https://...> autolinks
  return targets


def test_every_relative_link_in_the_readme_leads_to_a_file_of_the_repository():
  targets = readme_links()
  relative = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]
  missing = [t for t in relative if not (README.parent / t).exists()]
  assert relative and not missing, f"README.md links files that do not exist: {missing}"
  for page in ("docs/installation.md", "docs/getting_started.md", "CHANGELOG.md"):
    assert page in relative, f"README.md does not link {page}"
  assert "DESIGN.md" not in README.read_text(encoding="utf-8")


def test_the_readme_says_how_to_build_and_open_the_docs():
  section = README.read_text(encoding="utf-8").split("## Documentation", 1)[1]
  assert "sphinx-build -W -b html docs docs/_build/html" in section
  assert "docs/_build/html/index.html" in section


def test_the_quickstart_is_exactly_two_commands():
  section = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1]
  block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
  assert [line for line in block.splitlines() if line.strip()] == QUICKSTART

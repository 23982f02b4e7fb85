"""The suite's warning policy for the Python processes the suite starts (the tutorials
run as scripts, the docs build's notebook kernels): pyproject.toml's
``[tool.pytest.ini_options] filterwarnings``, read and applied as pytest applies it, so
the list is written once.
"""

import builtins
import tomllib
import warnings
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def entries() -> list[str]:
  """The ``action:message:category:module`` lines, in pyproject.toml's order."""
  with open(PYPROJECT, "rb") as f:
    return tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]


def apply() -> None:
  """Installs the filters; a later line wins over an earlier one, as in pytest (message
  and module are regular expressions, as in pytest's ini option)."""
  for entry in entries():
    action, message, category, module = (entry.split(":", 4) + [""] * 4)[:4]
    warnings.filterwarnings(
      action,
      message=message,
      category=getattr(builtins, category) if category else Warning,
      module=module,
    )

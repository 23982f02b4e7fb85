"""How the API pages write a signature: as a user would type it.

``autodoc_preserve_defaults`` shows each default as its source text, so a default held
in a private constant (``variable_axes=_ALL``) would show that name; a return annotation
resolved through a private module shows its path (``~statefulremat.core._state.State``).
Both are rewritten here to what users write: the constant's value as ``help()`` shows it
(``{True: 0}``: a ``FrozenMapping``'s repr is its dict literal), ``~statefulremat.State``.
Read by ``conf.py`` and by ``tests/test_docstrings.py``.
"""

from __future__ import annotations

import re

_PRIVATE_CONSTANT = re.compile(r"\b_[A-Z][A-Z0-9_]*\b")
_PRIVATE_PATH = re.compile(r"(~?)statefulremat(?:\.\w+)*?\._\w+(?:\.\w+)*?\.([A-Za-z]\w*)\b")


def readable_default(text: str, namespace: dict) -> str:
  """``text``, a default's source, with private constants of ``namespace`` (the defining
  module's globals) written as their values' reprs."""

  def constant(match: re.Match) -> str:
    if match.group(0) not in namespace:
      return match.group(0)
    value = namespace[match.group(0)]
    shown = repr(value)
    # A value whose repr is itself private (a function, a marker object) stays named.
    return match.group(0) if "<" in shown or _PRIVATE_CONSTANT.search(shown) else shown

  return _PRIVATE_CONSTANT.sub(constant, text)


def public_path(annotation: str, public: dict) -> str:
  """``annotation`` with each private path of a public class (``public``: the
  package's names) written as the public one."""

  def path(match: re.Match) -> str:
    name = match.group(2)
    if name in public:
      return f"{match.group(1)}statefulremat.{name}"
    return match.group(0)

  return _PRIVATE_PATH.sub(path, annotation)

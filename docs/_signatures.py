"""How the API pages write a signature: as a user would type it.

``autodoc_preserve_defaults`` shows each default as its source text, so a default held
in a private constant (``variable_axes=_ALL``) or an immutable mapping
(``MappingProxyType({})``) would show those names; a return annotation resolved through
a private module shows its path (``~statefulremat.core._state.State``). Both are
rewritten here to what users write: ``{True: 0}``, ``{}``, ``~statefulremat.State``.
Read by ``conf.py`` and by ``tests/test_docstrings.py``.
"""

from __future__ import annotations

import re
import types

_PROXY = re.compile(r"\b(?:types\.)?MappingProxyType\((\{.*?\})\)")
_PRIVATE_CONSTANT = re.compile(r"\b_[A-Z][A-Z0-9_]*\b")
_PRIVATE_PATH = re.compile(r"(~?)statefulremat(?:\.\w+)*?\._\w+(?:\.\w+)*?\.([A-Za-z]\w*)\b")


def readable_default(text: str, namespace: dict) -> str:
  """``text``, a default's source, with private constants of ``namespace`` (the defining
  module's globals) written as their values and immutable mappings as dict literals."""

  def constant(match: re.Match) -> str:
    if match.group(0) not in namespace:
      return match.group(0)
    value = namespace[match.group(0)]
    shown = repr(dict(value)) if isinstance(value, types.MappingProxyType) else repr(value)
    # A value whose repr is itself private (a function, a marker object) stays named.
    return match.group(0) if "<" in shown or _PRIVATE_CONSTANT.search(shown) else shown

  return _PROXY.sub(r"\1", _PRIVATE_CONSTANT.sub(constant, text))


def public_path(annotation: str, public: dict) -> str:
  """``annotation`` with each private path of a public class (``public``: the
  package's names) written as the public one."""

  def path(match: re.Match) -> str:
    name = match.group(2)
    if name in public:
      return f"{match.group(1)}statefulremat.{name}"
    return match.group(0)

  return _PRIVATE_PATH.sub(path, annotation)

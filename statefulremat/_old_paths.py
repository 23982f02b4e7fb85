"""The module paths of 0.1, before the floors, so what was pickled then still loads.

A pickle names each class by its module (``statefulremat._kinds.Param``); the modules
now live in floor folders (``statefulremat.core._kinds``). An import of an old name
gets the module at its new place, under both names, so ``pickle.load`` finds the
class. Nothing else imports the old names.

>>> import importlib, statefulremat as sr
>>> importlib.import_module("statefulremat._kinds").Param is sr.Param
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_CORE = (
  "_errors",
  "_tracing",
  "_variables",
  "_filters",
  "_containers",
  "_kinds",
  "_state",
  "_module",
  "_graph",
  "_rngs",
  "_graph_lock",
  "_graph_diff",
  "_pytree",
  "_split_merge",
  "_stacks",
)
MOVED = {
  **{name: f"core.{name}" for name in _CORE},
  "_transforms": "transforms",
  **{
    name: f"display.{name}"
    for name in (
      "_treescope",
      "_treescope_adapter",
      "_treescope_arrays",
      "_repr",
      "_display",
      "_summary",
      "_summary_norms",
      "_summary_outputs",
    )
  },
  "_checkpoint": "checkpoint._save_restore",
  "_checkpoint_files": "checkpoint._files",
  "_checkpoint_meta": "checkpoint._meta",
  "_checkpoint_sync": "checkpoint._sync",
  "_sharding": "distributed._sharding",
  "_optimizer": "optim._optimizer",
}
_PACKAGE = __name__.rpartition(".")[0]


def new_name(old: str) -> str | None:
  """``statefulremat._transforms._scan`` -> ``statefulremat.transforms._scan``."""
  prefix = _PACKAGE + "."
  if not old.startswith(prefix):
    return None
  head, dot, rest = old[len(prefix) :].partition(".")
  if head not in MOVED:
    return None
  return prefix + MOVED[head] + dot + rest


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  def find_spec(self, fullname, path=None, target=None):
    if new_name(fullname) is None:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec):
    target = new_name(spec.name)
    assert target is not None  # find_spec hands out specs for moved names only
    return importlib.import_module(target)

  def exec_module(self, module):
    pass  # the module at its new place is already loaded


def install() -> None:
  if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())  # before the path finder: no second copy

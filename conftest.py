"""The whole suite (tests and doctests) compiles with XLA:CPU's backend optimisation off,
and doctests run with rank promotion raising, like the tests, and find each public class
in the file that defines it."""

import doctest
import os

# The suite checks results and XLA's memory figures, never speed, and most of its time is
# XLA:CPU compiling: LLVM's optimisation off halves that. Buffer assignment, hence
# memory_analysis(), is decided before LLVM and does not change. Set before jax starts its
# backend; subprocesses (the docs build's kernels, the multi-process tests) inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  ).strip()

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

_from_module = doctest.DocTestFinder._from_module


def _from_defining_module(self, module, value) -> bool:
  # A public class names its public module (sr.State.__module__ == "statefulremat", for
  # pickles): doctest would look for its examples, and its methods', only there and find
  # the methods in neither file. Its own file keeps them all, collected once.
  from statefulremat.core._bookkeeping import DEFINED_IN

  defined_in = vars(value).get(DEFINED_IN) if isinstance(value, type) else None
  if defined_in is not None and module is not None:
    return module.__name__ == defined_in
  return _from_module(self, module, value)


doctest.DocTestFinder._from_module = _from_defining_module

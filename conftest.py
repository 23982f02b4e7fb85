"""The whole suite (tests and doctests) compiles for XLA:CPU with the code generator's
optimisation off, and doctests run with rank promotion raising, like the tests, and find
each public class in the file that defines it."""

import doctest
import os
from importlib.metadata import version


def fast_compile_flags() -> list[str]:
  """XLA:CPU flags that cut compile time and change no result the suite checks.

  The suite checks values and XLA's memory figures, never speed, and most of its time is
  XLA:CPU compiling (about 10,000 programs, most of them one eager op). These settings act
  after buffer assignment, so ``memory_analysis()`` is the same: LLVM's optimisation off
  (halves a compile), one code-generation thread (a small program pays for splitting),
  and, on jaxlib < 0.12, the older loop emitters (a third off again; 0.12 has only the
  new ones and, like every XLA, aborts on a flag it does not know)."""
  flags = ["--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1"]
  if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 12):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return flags


# Set before jax starts its backend; subprocesses (the docs build's kernels, the
# multi-process tests) and pytest-xdist's workers inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *fast_compile_flags()]
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

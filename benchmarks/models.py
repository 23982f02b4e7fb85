"""The deep-stack model and its constructions, one builder per library.

N layers of ``Linear W->W`` followed by ``tanh``; the loss is ``mean(out ** 2)``; every
benchmark differentiates it with respect to the parameters. Each library builds it with
the same five constructions:

* ``unrolled``: a Python loop over N separate layers;
* ``scan``: one ``lax.scan`` over stacked layers;
* ``scan_remat``: the same scan with the layer under ``jax.checkpoint``;
* ``remat_scan_d2`` / ``remat_scan_d3``: 2 or 3 nested scans, checkpointed at every level.

A builder is ``build(strategy, n, width, batch) -> Case``, or raises
:class:`NotApplicable`.
``Case.new(compiler_options)`` returns a freshly made jitted gradient function (fresh
closures and transform wrappers, so no cache survives from one call to the next) and
``Case.args`` the arguments to lower and call it with. ``compiler_options`` (XLA options,
used by ``--quick`` to compile faster) go to the library's jit where it takes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

STRATEGIES = ("unrolled", "scan", "scan_remat", "remat_scan_d2", "remat_scan_d3")
LIBRARIES = ("raw", "linen", "nnx", "sr")


class NotApplicable(Exception):
  """A library has no construction for this strategy; the message says why."""


@dataclasses.dataclass
class Case:
  """One library x strategy x depth: a jitted-gradient factory and its arguments."""

  new: Callable[[dict | None], Any]
  args: tuple


def lengths_for(n: int, depth: int) -> tuple[int, ...]:
  """Lengths of ``depth`` nested scans whose product is ``n``, as balanced as possible.

  >>> [lengths_for(n, 2) for n in (16, 64, 100, 256)]
  [(4, 4), (8, 8), (10, 10), (16, 16)]
  >>> [lengths_for(n, 3) for n in (16, 64, 100, 256)]
  [(2, 2, 4), (4, 4, 4), (4, 5, 5), (4, 8, 8)]
  """
  return min(_factorisations(n, depth), key=lambda split: (max(split), -min(split)))


def _factorisations(n: int, depth: int, low: int = 1):
  """Every ascending ``depth``-tuple of factors whose product is ``n``."""
  if depth == 1:
    if n >= low:
      yield (n,)
    return
  for f in range(low, n + 1):
    if n % f == 0:
      yield from ((f,) + rest for rest in _factorisations(n // f, depth - 1, f))


def strategy_lengths(strategy: str, n: int) -> tuple[int, ...] | None:
  """The nested-scan lengths a remat_scan strategy uses (None for the others)."""
  if strategy.startswith("remat_scan_d"):
    return lengths_for(n, int(strategy[-1]))
  return None


def host_init(abstract, seed: int = 0):
  """Gives every leaf of an abstract tree (``ShapeDtypeStruct``s) host-drawn values.

  Kernels are ``N(0, 1 / fan_in)``, everything else zeros. Initialisation is not what
  the suite measures: each library builds its model abstractly (``jax.eval_shape`` or
  ``nnx.eval_shape``), which skips a compiled init per depth (seconds on a small CPU),
  and every library gets the same distribution.
  """
  rng = np.random.default_rng(seed)

  def fill(path, s):
    if "kernel" in jax.tree_util.keystr(path):
      value = rng.standard_normal(s.shape, np.float32) / np.sqrt(s.shape[-2])
    else:
      value = np.zeros(s.shape, s.dtype)
    return jax.device_put(value)  # jnp.asarray would compile a copy per shape

  return jax.tree_util.tree_map_with_path(fill, abstract)


def inputs(batch: int, width: int):
  """The batch every construction is applied to: ones of shape (batch, width)."""
  return jax.device_put(np.ones((batch, width), np.float32))


def jit_options(compiler_options: dict | None) -> dict:
  """Keyword arguments for ``jax.jit`` / ``sr.jit``: none unless options are given."""
  return {"compiler_options": compiler_options} if compiler_options else {}


def builders() -> dict[str, Callable[..., Case]]:
  """``{library: build}``; the library modules are imported here, on demand."""
  from . import model_linen, model_nnx, model_raw, model_sr

  return {
    "raw": model_raw.build,
    "linen": model_linen.build,
    "nnx": model_nnx.build,
    "sr": model_sr.build,
  }

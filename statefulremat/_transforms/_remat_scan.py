"""sr.remat_scan: N = prod(lengths) layers in nested, rematerialised scans."""

from __future__ import annotations

import functools
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from ._class_form import display_name, is_module_class
from ._layers import LayerLoop
from ._lift import write_back
from ._rules import Rules, TransformError
from ._module_arg import (check_no_modules, compiled_when_eager, lift_module_arg,
                          resolve_length, stacked_sources)
from ._stacked import stacked_class

_ALL = MappingProxyType({True: 0})
_SPLIT_ALL = MappingProxyType({True: True})


def remat_scan(target: Callable | type | None = None, lengths: Sequence[int] = (), *,
               length: int | None = None, policy: Callable | None = None,
               variable_broadcast: Any = False, variable_carry: Any = False,
               variable_axes: Mapping = _ALL,
               split_rngs: Mapping = _SPLIT_ALL, prevent_cse: bool = False,
               data_transform: Callable | None = None,
               metadata_params: Mapping = MappingProxyType({}),
               methods: Sequence[str] | None = None):
  """Applies N layers (``length``, default prod(lengths)) with memory ~ N^(1/d) and
  flat compile time.

  ``remat_scan(f, lengths)(module, carry) -> carry`` is equivalent to::

      for layer in sr.unstack(module):     # N layers
        carry = f(layer, carry)

  but runs as ``d = len(lengths)`` nested ``jax.lax.scan``s, every level (the innermost
  included) under ``jax.checkpoint``: the backward pass keeps only each level's
  carries and recomputes the rest. ``policy`` applies to the innermost level only;
  outer levels save nothing but their carries (a saving policy there would keep every
  layer's residuals alive). Stacked variables keep ONE flat layer axis of size N — the
  nested shape exists only inside the trace, so changing ``lengths`` never changes the
  state. Any N works, primes included: with ``length=N < prod(lengths)`` the last
  segment is short (``lengths=(10, 10), length=97`` runs 9 full outer steps of 10 and
  one of 7), with no padding and no copies of parameter slices. The defaults stack
  every variable (``variable_axes={True: 0}``) and split every RNG stream. Keyword
  arguments (``remat_scan(f, lengths)(module, carry, flag=True)``)
  pass unchanged to every layer. ``data_transform`` and ``metadata_params`` are
  ``sr.scan``'s: a ``State -> State`` map of each layer's stacked values (e.g. a
  ``jax.lax.with_sharding_constraint``), and ``{"partition_name": name}`` for the layer
  axis's name in ``sharding`` metadata.

  The class form ``sr.remat_scan(Block, lengths=(10, 10))(*args, rngs=...)`` builds
  the N layers in one vmapped init; calling it runs ``Block.__call__(carry) -> carry``.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> Deep = sr.remat_scan(sr.nn.Linear, lengths=(4, 5))
  >>> deep = Deep(3, 3, rngs=sr.Rngs(0))
  >>> len(deep), deep.kernel.shape
  (20, (20, 3, 3))
  >>> y = deep(jnp.ones((2, 3)))
  >>> x = jnp.ones((2, 3))
  >>> for layer in sr.unstack(deep):
  ...   x = layer(x)
  >>> bool(jnp.allclose(x, y, rtol=1e-4))
  True
  """
  options = dict(policy=policy, variable_broadcast=variable_broadcast,
                 variable_carry=variable_carry, variable_axes=variable_axes,
                 split_rngs=split_rngs, prevent_cse=prevent_cse,
                 data_transform=data_transform, metadata_params=metadata_params)
  lengths = tuple(lengths)
  if target is None:
    return functools.partial(remat_scan, lengths=lengths, length=length, methods=methods,
                             **options)
  what = f"sr.remat_scan({display_name(target)})"
  n = _check_lengths(what, lengths, length)
  if is_module_class(target):
    rules = Rules(what, variable_axes=variable_axes, variable_broadcast=variable_broadcast,
                  variable_carry=variable_carry, split_rngs=split_rngs)
    cls = stacked_class(target, "RematScan", rules=rules, length=n,
                        wrap=lambda m: remat_scan(m, lengths, length=n, **options),
                        methods=methods, metadata_params=metadata_params)
    cls._sr_lengths = lengths  # the nested layout, for sr.interop.to_linen
    return cls
  if methods is not None:
    raise TypeError("sr.remat_scan(methods=...) applies to a Module class, not a function.")
  return _remat_scan_function(target, lengths, n, what=what, **options)


def _check_lengths(what: str, lengths: tuple, length: int | None) -> int:
  """The number of layers N, after checking ``lengths`` and ``length`` agree."""
  if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                        for n in lengths):
    raise TransformError(
        f"{what}: lengths={lengths!r} must be a non-empty tuple of positive ints, one "
        "per level of nesting, e.g. lengths=(10, 10) for 100 layers (or "
        "lengths=(10, 10), length=97 for 97).")
  total = math.prod(lengths)
  if length is None:
    return total
  if not isinstance(length, int) or isinstance(length, bool) or length < 1:
    raise TransformError(f"{what}: length={length!r} must be a positive int, the number "
                         "of layers.")
  if length > total:
    raise TransformError(
        f"{what}: lengths={lengths} cover {total} layers, fewer than length={length}. "
        f"Fix: lengths whose product is at least {length}, e.g. "
        f"{_covering(length, len(lengths))}; the last segment may be short.")
  if total - length >= total // lengths[0]:
    raise TransformError(
        f"{what}: lengths={lengths} cover {total} layers; with length={length} at least "
        f"one whole outer step ({total // lengths[0]} layers) would run nothing. Fix: "
        f"{_covering(length, len(lengths))}.")
  return length


def _covering(n: int, depth: int) -> str:
  """The smallest balanced ``lengths`` of ``depth`` levels covering ``n`` layers."""
  base = max(1, round(n ** (1 / depth)))
  lengths = [base] * depth
  i = 0
  while math.prod(lengths) < n:
    lengths[i % depth] += 1
    i += 1
  return f"lengths={tuple(lengths)}"


def _remat_scan_function(fn: Callable, lengths: tuple, n: int, *, what, policy,
                         variable_broadcast, variable_carry, variable_axes, split_rngs,
                         prevent_cse, data_transform, metadata_params) -> Callable:
  rules = Rules(what, variable_axes=variable_axes, variable_broadcast=variable_broadcast,
                variable_carry=variable_carry, split_rngs=split_rngs)
  ragged = n != math.prod(lengths)
  label = f"length={n}" if ragged else f"lengths={lengths} (product)"

  @functools.wraps(fn)
  def wrapper(module, carry, **kwargs):
    check_no_modules(carry, what, "the carry")
    check_no_modules(kwargs, what, "the keyword argument")
    lifted, variables, plan, leaves = lift_module_arg(
        module, what, rules, metadata_params, "f(module, carry) -> carry")
    sources = stacked_sources(plan, lifted, variables)
    resolve_length(what, None, [(label, n)] + sources)
    loop = LayerLoop(lifted, plan, variables, leaves, what, data_transform)

    def body(tree, c, _):
      return fn(tree[0][0], c, **kwargs), None

    if ragged:
      carry, _, changed = loop.run_segments(body, carry, n, lengths, policy=policy,
                                            prevent_cse=prevent_cse)
    else:
      carry, _, changed = loop.run(body, carry, None, lengths, remat=True, policy=policy,
                                   prevent_cse=prevent_cse)
    write_back(variables, changed, what)
    return carry

  return compiled_when_eager(wrapper)

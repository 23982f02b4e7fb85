"""The recurrent cell protocol: ``RNNCellBase``, one time step ``cell(carry, x) ->
(carry, y)``, with the carry's making (``initialize_carry``, ``carry_shapes``) and the
checks of a step's input and carry that name the cell's path (``check_step``). The
cells themselves are in ``_cells``; ``sr.nn.RNN`` (``_rnn``) scans any of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core._frozen import EMPTY as _EMPTY
from ..core._module import Module
from ..core._rngs import Rngs, RngStream
from ._linear import Initializer, Linear, default_bias_init, named
from ._rngs_arg import check_rngs


def where(module) -> str:
  """``"LSTMCell at `path`"`` (the module's path in its model), or the class name."""
  return named(type(module).__name__, module)


class RNNCellBase(Module):
  """Base class of the recurrent cells: one time step, ``cell(carry, x) -> (carry, y)``.

  A cell of one's own (a ConvLSTM) subclasses it and defines ``__call__``,
  ``initialize_carry(input_shape, rngs=None, carry_init=None)`` and
  ``num_feature_axes`` (how many trailing axes of the input are features; ``RNN``
  finds the time axis from it). The cells here also keep ``in_features`` and
  ``hidden_features`` and check their inputs against them.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> cell = sr.nn.GRUCell(3, 4, rngs=sr.Rngs(0))
  >>> isinstance(cell, sr.nn.RNNCellBase), cell.num_feature_axes
  (True, 1)
  """

  #: carry arrays of the cell: 1 (``h``), or 2 for the LSTMs (``(c, h)``)
  _carry_arity = 1
  #: whether ``check_step`` knows the cell's input and carry (the cells here do; a
  #: subclass of this base with a carry of its own is not checked)
  _checks_steps = False

  def _setup(
    self,
    name: str,
    in_features: int,
    hidden_features: int,
    dtype: Any,
    param_dtype: Any,
    promote_dtype: Callable,
    rngs: Rngs,
  ) -> Callable[..., Linear]:
    """Checks and keeps the arguments every cell takes but the carry's (``_keep_carry``);
    returns ``dense(in_features, out_features, kernel_init, kernel_metadata, bias=None)``,
    which makes a ``Linear`` sub-layer in the cell's dtypes from ``rngs`` (``bias``: its
    ``(init, metadata)``, or None for none)."""
    check_rngs(name, rngs)
    for arg, value in (("in_features", in_features), ("hidden_features", hidden_features)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}.")
    self.in_features = in_features
    self.hidden_features = hidden_features
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.promote_dtype = promote_dtype

    def dense(in_features, out_features, kernel_init, kernel_metadata, bias=None) -> Linear:
      bias_init, bias_metadata = bias or (default_bias_init, _EMPTY)
      return Linear(
        in_features,
        out_features,
        use_bias=bias is not None,
        kernel_init=kernel_init,
        bias_init=bias_init,
        dtype=dtype,
        param_dtype=param_dtype,
        promote_dtype=promote_dtype,
        rngs=rngs,
        kernel_metadata=kernel_metadata,
        bias_metadata=bias_metadata,
      )

    return dense

  def _keep_carry(
    self, name: str, keep_rngs: bool, carry_init: Initializer | None, rngs: Rngs
  ) -> None:
    """Keeps the carry's options, warning about those nnx deprecates or warns about.
    Call it right after ``_setup``, from the cell's ``__init__`` (the warnings'
    ``stacklevel`` names the code building the cell)."""
    if keep_rngs:
      warnings.warn(
        f"{name}(keep_rngs=True) is deprecated, as in flax.nnx: pass the rngs to "
        "`initialize_carry(input_shape, rngs)` (or `RNN(...)(x, rngs=rngs)`) instead.",
        DeprecationWarning,
        stacklevel=3,
      )
      self.rngs = RngStream(rngs.carry(), tag="carry")
    else:
      self.rngs = None
    if carry_init is not None:
      warnings.warn(
        f"{name}: carry_init given to the constructor, as flax.nnx still allows but "
        "warns about: two cells that differ only in it have different graph "
        "definitions. Pass it to `initialize_carry(input_shape, rngs, carry_init=...)` "
        "instead.",
        UserWarning,
        stacklevel=3,
      )
    self.carry_init = carry_init

  @property
  def num_feature_axes(self) -> int:
    """How many trailing axes of the input are features (1 for these cells)."""
    return 1

  def initialize_carry(
    self,
    input_shape: tuple,
    rngs: Rngs | RngStream | None = None,
    carry_init: Initializer | None = None,
  ):
    """The carry for a time step of inputs of shape ``input_shape`` ``(*batch, in)``.

    Each carry array has shape ``(*batch, hidden_features)`` and dtype ``param_dtype``:
    zeros, or drawn from ``carry_init(key, shape, dtype)`` with keys from ``rngs`` (an
    ``sr.Rngs``'s ``carry`` stream, an ``sr.RngStream``, or the cell's own stream
    when built with ``keep_rngs=True``). Zeros need no keys, so ``rngs`` may be
    omitted then (nnx insists on one).

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> c, h = sr.nn.LSTMCell(3, 4, rngs=sr.Rngs(0)).initialize_carry((2, 3))
    >>> c.shape, h.shape
    ((2, 4), (2, 4))
    """
    init = carry_init if carry_init is not None else self.carry_init
    shape = tuple(input_shape)[:-1] + (self.hidden_features,)
    if init is None:
      zeros = jnp.zeros(shape, self.param_dtype)
      return (zeros, zeros) if self._carry_arity == 2 else zeros
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, Rngs):
      rngs = rngs.carry
    if rngs is None:
      raise ValueError(
        f"{where(self)}: initialize_carry with carry_init={init!r} draws keys, but no "
        "rngs was given and the cell keeps none. Fix: pass them, "
        "`cell.initialize_carry(input_shape, sr.Rngs(0))` (its `carry` stream)."
      )
    carries = tuple(init(rngs(), shape, self.param_dtype) for _ in range(self._carry_arity))
    return carries if self._carry_arity == 2 else carries[0]

  def carry_shapes(self, input_shape: tuple):
    """The shape of each carry array for inputs of ``input_shape`` (a pair for LSTMs).

    >>> import statefulremat as sr
    >>> sr.nn.GRUCell(3, 4, rngs=sr.Rngs(0)).carry_shapes((5, 3))
    (5, 4)
    """
    shape = tuple(input_shape)[:-1] + (self.hidden_features,)
    return (shape, shape) if self._carry_arity == 2 else shape

  def check_step(self, carry, input_shape: tuple, *, exact: bool = False) -> None:
    """Raises a ``ValueError`` naming the cell's path unless ``carry`` and an input of
    ``input_shape`` fit it: features ``in_features``, carry arrays ``(..., hidden)``
    (``exact``: exactly ``carry_shapes(input_shape)``, as a scan over time needs)."""
    if not self._checks_steps:
      return
    input_shape = tuple(input_shape)
    if not input_shape or input_shape[-1] != self.in_features:
      fix = (
        f"build the cell with in_features={input_shape[-1]}"
        if input_shape
        else "give the input a feature axis, e.g. `x[..., None]`"
      )
      raise ValueError(
        f"{where(self)} was built with in_features={self.in_features} but got an "
        f"input of shape {input_shape} (expected (*batch, {self.in_features})). Fix "
        f"the input, or {fix}."
      )
    target = input_shape[:-1] + (self.hidden_features,)  # each carry array's shape
    if self._carry_arity == 2:
      ok = isinstance(carry, (tuple, list)) and len(carry) == 2
      leaves = list(carry) if ok else []
      want = f"a pair (c, h) of arrays of shape {target}"
    else:
      ok = not isinstance(carry, (tuple, list, dict))
      leaves = [carry] if ok else []
      want = f"one array of shape {target}"
    shapes = [tuple(jnp.shape(leaf)) for leaf in leaves]
    ok = ok and all((s == target) if exact else (s[-1:] == target[-1:]) for s in shapes)
    if not ok:
      got = jax.tree.map(lambda leaf: tuple(jnp.shape(leaf)), carry)
      raise ValueError(
        f"{where(self)}: the carry has shapes {got}, but for inputs of shape "
        f"{input_shape} it must be {want} (batch dims, then hidden_features="
        f"{self.hidden_features}). Fix: start from "
        f"`cell.initialize_carry({input_shape})`."
      )

"""RNN: a recurrent cell scanned over time with ``sr.scan``; ``Bidirectional``; as
``flax.nnx``'s ``RNN`` and ``Bidirectional``; and the cell protocol they scan,
``RNNCellBase``: one time step ``cell(carry, x) -> (carry, y)``, with the carry's making
(``initialize_carry``, ``carry_shapes``) and the checks of a step's input and carry that
name the cell's path (``check_step``). The cells themselves are in ``_cells``.

The cell is the scanned module: its parameters are broadcast (the same weights at
every step, gradients summed over the steps), its other variables (a BatchNorm's
statistics, what ``sow`` stores) carried from step to step, and its RNG streams
split per step unless ``broadcast_rngs`` names them, so a dropout inside a cell draws a
new mask at every step as nnx's carried streams do.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core._filters import Not
from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import Param
from ..core._module import Module
from ..core._rngs import Rngs, RngStream
from ..transforms import scan
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


def flip_sequences(
  inputs: jax.Array, seq_lengths: jax.Array | None, num_batch_dims: int, time_major: bool
) -> jax.Array:
  """Reverses each sequence along the time axis, keeping the padding at the end.

  With ``seq_lengths``, sequence ``b`` has ``seq_lengths[b]`` valid steps followed by
  padding; only the valid steps are reversed (padding stays behind them), which is
  what the backward direction of a bidirectional RNN needs. Without, the whole time
  axis is reversed. As ``flax.nnx.nn.recurrent.flip_sequences``.

  >>> import jax.numpy as jnp
  >>> from statefulremat.nn._rnn import flip_sequences
  >>> x = jnp.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]])
  >>> flip_sequences(x, jnp.array([1, 2, 3]), 1, False).tolist()
  [[1, 0, 0], [3, 2, 0], [6, 5, 4]]
  """
  time_axis = 0 if time_major else num_batch_dims
  if seq_lengths is None:
    return jnp.flip(inputs, axis=time_axis)
  steps = inputs.shape[time_axis]
  # Step t reads (lengths - 1 - t) mod steps: the valid part reversed, then the padding.
  idxs = jnp.arange(steps - 1, -1, -1)
  idxs = idxs.reshape(
    (steps,) + (1,) * num_batch_dims if time_major else (1,) * num_batch_dims + (steps,)
  )
  idxs = (idxs + jnp.expand_dims(seq_lengths, time_axis)) % steps
  idxs = idxs.reshape(idxs.shape + (1,) * (inputs.ndim - idxs.ndim))
  return jnp.take_along_axis(inputs, idxs, axis=time_axis)


def _step(cell, carry, x):
  return cell(carry, x)


def _step_keeping_last(cell, carries, x, t, seq_lengths):
  """A step that also keeps, per sequence, the carry after its last valid step."""
  carry, last = carries
  carry, y = cell(carry, x)
  valid = t < seq_lengths

  def keep(new, old):
    mask = valid.reshape(valid.shape + (1,) * (jnp.ndim(new) - valid.ndim))
    return jnp.where(mask, new, old)

  return (carry, jax.tree.map(keep, carry, last)), y


@functools.lru_cache(maxsize=256)
def _scanner(
  time_axis: int, unroll, keep_last: bool, broadcast_rngs, variable_broadcast, variable_carry
) -> Callable:
  """One ``sr.scan`` per configuration, built once: its compiled eager call is reused."""
  split = {True: True} if broadcast_rngs is None else {broadcast_rngs: False, True: True}
  body, in_axes = (_step_keeping_last, (time_axis, 0, None)) if keep_last else (_step, time_axis)
  return scan(
    body,
    variable_broadcast=variable_broadcast,
    variable_carry=variable_carry,
    split_rngs=split,
    in_axes=in_axes,
    out_axes=time_axis,
    unroll=unroll,
  )


def _carry_stream(rngs, owner: str):
  """What ``rngs=`` of an RNN or a Bidirectional keeps: a ``carry`` stream or None."""
  if rngs is True:
    return RngStream(0, tag="carry")
  if rngs is False or rngs is None:
    return None
  if isinstance(rngs, Rngs):
    return RngStream(rngs.carry(), tag="carry")  # a fork: its own counter
  if isinstance(rngs, RngStream):
    return rngs
  raise TypeError(
    f"{owner}: rngs must be True (a stream seeded 0, as nnx), False, an sr.Rngs or an "
    f"sr.RngStream, got {type(rngs).__name__}. It only seeds initialize_carry's "
    "carry_init. Fix: `rngs=sr.Rngs(0)`, or leave it out."
  )


class RNN(Module):
  """Applies a recurrent cell over the time axis of a sequence, as ``flax.nnx.RNN``.

  Equivalent to this Python loop, traced once by ``sr.scan``::

      carry = initial_carry or cell.initialize_carry(x[:, 0].shape, rngs)
      for t in range(time):                       # x flipped first if reverse
        carry, y[:, t] = cell(carry, x[:, t])
      return (carry, y) if return_carry else y

  Inputs are ``(*batch, time, *features)``, or ``(time, *batch, *features)`` with
  ``time_major=True`` (``cell.num_feature_axes`` counts the feature axes). With
  ``seq_lengths`` (one length per batch entry) ``reverse`` flips only each
  sequence's valid steps (``flip_sequences``: the padding stays at the end), and the
  carry returned is each sequence's carry after its last valid step, as nnx gives it
  (a length of 0 gives the initial carry, where nnx wraps around to the last step).
  As in nnx the outputs at padded steps are what the cell computes there (not zeros):
  mask them. ``reverse=True`` with ``keep_order=True`` flips the outputs back into
  the input's order.

  The cell's parameters are broadcast (``variable_broadcast``), its other variables
  carried (``variable_carry``); its RNG streams are split per step except those
  ``broadcast_rngs`` names (the same key at every step).

  Args:
    cell: an ``RNNCellBase`` (``LSTMCell``, ``GRUCell``, ...) or a module shaped like
      one.
    time_major: default of the call's ``time_major``: inputs ``(time, *batch,
      *features)`` (default ``False``).
    return_carry: default of the call's ``return_carry``: return ``(carry, outputs)``
      instead of ``outputs`` (default ``False``).
    reverse: default of the call's ``reverse``: run from the last step to the first
      (default ``False``).
    keep_order: default of the call's ``keep_order``: with ``reverse``, flip the
      outputs back into the input's order (default ``False``).
    unroll: time steps per loop iteration (``jax.lax.scan``'s ``unroll``; default
      ``1``, ``True`` unrolls fully).
    variable_broadcast: filter of the cell's variables shared by every step, as in
      ``sr.scan`` (default ``sr.Param``).
    variable_carry: filter of the cell's variables carried from step to step, as in
      ``sr.scan`` (default ``sr.Not(sr.Param)``: everything but the parameters).
    broadcast_rngs: a stream filter (e.g. ``"dropout"``): streams that give every
      step the same key (default ``None``: every stream split per step).
    rngs: ``True`` (a ``carry`` stream seeded 0, as nnx; the default), an ``sr.Rngs``
      (forks its ``carry`` stream), an ``sr.RngStream``, or ``False``; it seeds a
      cell's ``carry_init`` when the call gives no ``rngs`` (zeros need none).
    state_axes: nnx's argument, refused: spell it with ``variable_broadcast`` and
      ``variable_carry``. Must stay ``None`` (the default).

  Raises:
    TypeError: when ``state_axes`` is given, ``cell`` is not a ``Module``, or ``rngs``
      is none of the above.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> rnn = sr.nn.RNN(sr.nn.LSTMCell(3, 4, rngs=sr.Rngs(0)), return_carry=True)
  >>> (c, h), y = rnn(jnp.ones((2, 5, 3)))             # batch 2, 5 steps
  >>> c.shape, y.shape, bool(jnp.allclose(h, y[:, -1]))
  ((2, 4), (2, 5, 4), True)
  >>> y = rnn(jnp.ones((2, 5, 3)), seq_lengths=jnp.array([5, 2]), return_carry=False)
  >>> y.shape
  (2, 5, 4)
  """

  def __init__(
    self,
    cell: Module,
    *,
    time_major: bool = False,
    return_carry: bool = False,
    reverse: bool = False,
    keep_order: bool = False,
    unroll: int | bool = 1,
    variable_broadcast: Any = Param,
    variable_carry: Any = Not(Param),  # noqa: B008 (a filter is immutable)
    broadcast_rngs: Any = None,
    rngs: Any = True,
    state_axes: Any = None,
  ):
    if state_axes is not None:
      raise TypeError(
        "RNN(state_axes=...): nnx's StateAxes are spelled with sr.scan's rules here. "
        "Fix: `variable_broadcast=<filter>` for nnx's None entries (default sr.Param) "
        "and `variable_carry=<filter>` for its nnx.Carry entries (default everything "
        "else)."
      )
    if not isinstance(cell, Module):
      raise TypeError(
        f"RNN: cell must be a recurrent cell module (e.g. "
        f"sr.nn.LSTMCell(...)), got {type(cell).__name__}."
      )
    self.cell: Any = cell  # an RNNCellBase, or any Module shaped like one
    self.time_major = time_major
    self.return_carry = return_carry
    self.reverse = reverse
    self.keep_order = keep_order
    self.unroll = unroll
    self.variable_broadcast = variable_broadcast
    self.variable_carry = variable_carry
    self.broadcast_rngs = broadcast_rngs
    self.rngs = _carry_stream(rngs, "RNN")

  def __call__(
    self,
    inputs: jax.Array,
    *,
    initial_carry: Any = None,
    seq_lengths: jax.Array | None = None,
    return_carry: bool | None = None,
    time_major: bool | None = None,
    reverse: bool | None = None,
    keep_order: bool | None = None,
    rngs: Any = None,
  ):
    """Scans the cell over ``inputs``; returns ``outputs`` or ``(carry, outputs)``.

    Arguments left ``None`` take the constructor's value; ``rngs`` (an ``sr.Rngs``,
    whose ``carry`` stream is drawn, or an ``sr.RngStream``) seeds the carry's
    ``carry_init``.
    """
    return_carry = self.return_carry if return_carry is None else return_carry
    time_major = self.time_major if time_major is None else time_major
    reverse = self.reverse if reverse is None else reverse
    keep_order = self.keep_order if keep_order is None else keep_order
    cell = self.cell
    features = cell.num_feature_axes
    shape = tuple(jnp.shape(inputs))
    if len(shape) < features + 1:
      layout = "(time, *batch, *features)" if time_major else "(*batch, time, *features)"
      raise ValueError(
        f"{where(self)}: inputs of shape {shape} have no time axis: the cell takes "
        f"{features} feature axis(es), so inputs are {layout}. Fix: add the time axis, "
        "e.g. `x[:, None]` for one step (or call the cell itself)."
      )
    time_axis = 0 if time_major else len(shape) - features - 1
    batch = shape[1 : len(shape) - features] if time_major else shape[:time_axis]
    step_shape = shape[:time_axis] + shape[time_axis + 1 :]
    if seq_lengths is not None and tuple(jnp.shape(seq_lengths)) != batch:
      raise ValueError(
        f"{where(self)}: seq_lengths has shape {tuple(jnp.shape(seq_lengths))}, but "
        f"inputs of shape {shape} have batch shape {batch}: one length per sequence. "
        f"Fix: pass an int array of shape {batch}."
      )
    rngs = self.rngs if rngs is None else rngs
    carry = cell.initialize_carry(step_shape, rngs) if initial_carry is None else initial_carry
    if isinstance(cell, RNNCellBase):
      # Here, with the cell's path, not as a tracer-shape error deep in the scan.
      cell.check_step(carry, step_shape, exact=True)
    if reverse:
      inputs = flip_sequences(inputs, seq_lengths, len(batch), time_major)
    keep_last = seq_lengths is not None and return_carry
    options = (
      time_axis,
      self.unroll,
      keep_last,
      self.broadcast_rngs,
      self.variable_broadcast,
      self.variable_carry,
    )
    try:
      scanned = _scanner(*options)
    except TypeError:  # an unhashable filter (a list): built afresh, compiled per call
      scanned = _scanner.__wrapped__(*options)
    if keep_last:
      (_, carry), outputs = scanned(
        cell, (carry, carry), inputs, jnp.arange(shape[time_axis]), seq_lengths
      )
    else:
      carry, outputs = scanned(cell, carry, inputs)
    if reverse and keep_order:
      outputs = flip_sequences(outputs, seq_lengths, len(batch), time_major)
    return (carry, outputs) if return_carry else outputs


def _concatenate(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.concatenate([a, b], axis=-1)


class Bidirectional(Module):
  """Runs one RNN forward and another backward over the input and merges their outputs,
  as ``flax.nnx.Bidirectional``.

  The backward RNN reads each sequence reversed (only its valid steps with
  ``seq_lengths``) and its outputs are put back in the input's order, so step ``t`` of
  the result is ``merge_fn(forward[t], backward[t])`` (default: concatenated features).
  The carry returned (``return_carry``) is ``(forward_carry, backward_carry)``, and an
  ``initial_carry`` is such a pair. Passing the same RNN twice shares its parameters.

  Args:
    forward_rnn: the ``RNN`` run forward over the input.
    backward_rnn: the ``RNN`` run backward (the same one shares its parameters).
    merge_fn: ``merge_fn(forward_out, backward_out)`` -> the output at each step;
      default ``None``: the two concatenated along the last (feature) axis.
    time_major: default of the call's ``time_major``: inputs ``(time, *batch,
      *features)`` instead of ``(*batch, time, *features)`` (default ``False``).
    return_carry: default of the call's ``return_carry``: also return
      ``(forward_carry, backward_carry)`` (default ``False``).
    rngs: ``True`` (a ``carry`` stream seeded 0, as nnx; the default), an ``sr.Rngs``
      (forks its ``carry`` stream), an ``sr.RngStream``, or ``False``; it seeds the
      cells' ``carry_init`` when the call gives no ``rngs``.

  Raises:
    TypeError: when ``rngs`` is none of those.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> layer = sr.nn.Bidirectional(sr.nn.RNN(sr.nn.GRUCell(3, 4, rngs=sr.Rngs(0))),
  ...                             sr.nn.RNN(sr.nn.GRUCell(3, 4, rngs=sr.Rngs(1))))
  >>> layer(jnp.ones((2, 5, 3))).shape
  (2, 5, 8)
  """

  def __init__(
    self,
    forward_rnn: RNN,
    backward_rnn: RNN,
    *,
    merge_fn: Callable | None = None,
    time_major: bool = False,
    return_carry: bool = False,
    rngs: Any = True,
  ):
    self.forward_rnn = forward_rnn
    self.backward_rnn = backward_rnn
    self.merge_fn = _concatenate if merge_fn is None else merge_fn
    self.time_major = time_major
    self.return_carry = return_carry
    self.rngs = _carry_stream(rngs, "Bidirectional")

  def __call__(
    self,
    inputs: jax.Array,
    *,
    initial_carry: Any = None,
    rngs: Any = None,
    seq_lengths: jax.Array | None = None,
    return_carry: bool | None = None,
    time_major: bool | None = None,
    reverse: bool | None = None,
    keep_order: bool | None = None,
  ):
    """Returns the merged outputs, or ``((forward_carry, backward_carry), outputs)``.

    ``reverse`` and ``keep_order`` are accepted for nnx's signature and ignored.
    """
    del reverse, keep_order  # the two directions are this layer's own
    time_major = self.time_major if time_major is None else time_major
    return_carry = self.return_carry if return_carry is None else return_carry
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, Rngs):
      rngs = rngs.carry
    forward, backward = (None, None) if initial_carry is None else initial_carry
    common = dict(rngs=rngs, seq_lengths=seq_lengths, return_carry=True, time_major=time_major)
    carry_f, out_f = self.forward_rnn(inputs, initial_carry=forward, reverse=False, **common)
    carry_b, out_b = self.backward_rnn(
      inputs, initial_carry=backward, reverse=True, keep_order=True, **common
    )
    outputs = jax.tree.map(self.merge_fn, out_f, out_b)
    return ((carry_f, carry_b), outputs) if return_carry else outputs

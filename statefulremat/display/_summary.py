"""``sr.summary``: a table of a model's modules — class, parameter count, bytes per
collection and output shapes — traced with ``jax.eval_shape``, so nothing is computed;
for each stack, the L2 norm of each layer's parameters (and of their gradients, given
``grads``), as levanter logs them for its scanned stacks.

Every module and Variable is listed once, at the path ``sr.state`` gives it: a shared
one (an Rngs handed to several layers) under the owner the GraphDef's sorted walk
reaches first, wherever the definition order meets it first.

The parts run one way: ``_summary_walk`` walks the model once into a ``Description``;
``_summary_outputs`` (output shapes, caught while tracing) and the norms (``Norms``,
here) read that description; this file puts the table together. None walks the model
again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..core._errors import format_path
from ..core._module import Module
from ..core._split_merge import node_at
from ..core._stacks import stack_info
from ._array_stats import is_concrete, squares
from ._pattern_names import pattern_names
from ._repr import class_text, layer_numbers, layers_text, pattern_text, position_text
from ._summary_outputs import OUTPUT_WIDTH, shorten, trace_outputs
from ._summary_walk import Description, ModuleEntry, describe


@dataclasses.dataclass(frozen=True)
class SummaryRow:
  """One module of a summary: its counts cover the module and everything below it.

  ``layers`` is the number of layers its stacked variables hold (1 outside a stack),
  ``params_per_layer`` the stacked parameters of one layer and ``params_unstacked`` the
  ones a stack broadcasts (held once). ``outputs`` has one shape text per call.
  ``param_norm`` is the L2 norm of the module's Params and ``grad_norm`` that of their
  gradients, given ``grads`` (the table shows both then); None where there is none
  (no Params, no ``grads``, an abstract model). For a stack of a repeating pattern,
  ``pattern`` says how its layers repeat (``26 layers: (Local, Local, Global) × 8 +
  (Local, Local)``) and ``layers`` counts them all; ``position`` says, for the stack of
  one of its positions, which layers of the whole it holds; both None elsewhere.
  Where a pattern's elements are named by short labels, ``legend`` says what each
  stands for (``Block#1 = partial(Block, window=512)``).

  ``sr.summary`` makes the rows; build one yourself only to test how a row shows.

  Args:
    path: the module's path in the model (``("blocks", 0)``); ``()`` for the root.
    class_name: the module's class as the table shows it (``"Linear"``,
      ``"Vmap[Linear]"``).
    params: the number of parameters of the module and all below it.
    bytes: the bytes its variables take, per collection (``{"params": 32}``).
    layers: the number of layers its stacked variables hold; 1 (the default) outside
      a stack.
    params_per_layer: the stacked parameters of one layer; 0 by default.
    params_unstacked: the parameters a stack broadcasts, held once; 0 by default.
    outputs: one shape text per call (``("float32[5,2]",)``); none by default.
    param_norm: the L2 norm of its Params; None (the default) where there is none.
    grad_norm: the L2 norm of their gradients; None (the default) without ``grads``.
    pattern: how a pattern stack's layers repeat; None (the default) elsewhere.
    position: which layers of the whole pattern stack a position's stack holds; None
      (the default) elsewhere.
    legend: what each short label of ``pattern`` stands for; none by default.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Stack = sr.vmap(sr.nn.Linear, axis_size=4)
  >>> row = sr.summary(Stack(2, 3, rngs=sr.Rngs(0)), jnp.ones((4, 5, 2))).rows[0]
  >>> row.params, row.layers, row.params_per_layer, row.params_text(), row.outputs
  (36, 4, 9, '36 (4 × 9)', ('float32[4,5,3]',))
  """

  path: tuple
  class_name: str
  params: int
  bytes: dict[str, int]
  layers: int = 1
  params_per_layer: int = 0
  params_unstacked: int = 0
  outputs: tuple[str, ...] = ()
  param_norm: float | None = None
  grad_norm: float | None = None
  pattern: str | None = None
  position: str | None = None
  legend: tuple[str, ...] = ()

  @property
  def path_text(self) -> str:
    return format_path(self.path) if self.path else "(root)"

  def params_text(self) -> str:
    """The parameter count as the table shows it: with thousands separators, and for
    a stacked row ``(layers × per layer + unstacked)``.

    >>> import statefulremat as sr
    >>> sr.SummaryRow(("mlp",), "MLP", 1234, {}).params_text()
    '1,234'
    >>> sr.SummaryRow(("blocks",), "Block", 12100, {}, layers=3, params_per_layer=4000,
    ...               params_unstacked=100).params_text()
    '12,100 (3 × 4,000 + 100)'
    """
    if self.pattern is not None:
      return f"{self.params:,} ({layers_text(self.layers)})"
    if self.layers == 1:
      return f"{self.params:,}"
    extra = f" + {self.params_unstacked:,}" if self.params_unstacked else ""
    return f"{self.params:,} ({self.layers} × {self.params_per_layer:,}{extra})"

  def outputs_text(self, width: int = OUTPUT_WIDTH) -> str:
    """The output column: the distinct shapes joined by ``' / '`` and ``×n`` for ``n``
    calls; ``-`` when the module was not called. A text longer than ``width`` (a dict
    of many outputs) is shortened: dtypes as jaxprs write them, and cut after the items
    that fit, ``…`` for the rest (``outputs`` keeps it whole; see ``shorten``); past
    ``width`` in all, ``/ …`` stands for the other shapes.

    >>> import statefulremat as sr
    >>> row = sr.SummaryRow(("head",), "Linear", 8, {},
    ...                     outputs=("float32[5,2]", "float32[5,2]", "float32[1,2]"))
    >>> row.outputs_text(), sr.SummaryRow((), "Linear", 8, {}).outputs_text()
    ('float32[5,2] / float32[1,2] ×3', '-')
    >>> out = "{'logits': float32[2,8], 'cache': {'k': float32[2,4], 'v': float32[2,4]}}"
    >>> sr.SummaryRow(("block",), "Block", 8, {}, outputs=(out,)).outputs_text(width=50)
    "{'logits': f32[2,8], 'cache': {'k': f32[2,4], …}}"
    """
    if not self.outputs:
      return "-"
    distinct = [shorten(text, width) for text in dict.fromkeys(self.outputs)]
    calls = f" ×{len(self.outputs)}" if len(self.outputs) > 1 else ""
    shown = distinct[:1]
    for text in distinct[1:]:
      if len(" / ".join([*shown, text])) > width:
        shown.append("…")
        break
      shown.append(text)
    return " / ".join(shown) + calls


class Summary(str):
  """The table ``sr.summary`` returns: a ``str``, the text table (as ``nnx.tabulate``
  returns one), that keeps its parts; treescope draws it.

  ``rows`` lists every module (the root first, then depth first in definition order);
  ``total_params`` and ``total_bytes`` count each Variable once, shared or not.
  ``layer_norms`` has a ``LayerNorms`` per stack; ``norms()`` gives every norm under
  the keys a metrics logger takes.

  ``sr.summary`` makes it; building one from its parts writes the text table anew.

  Args:
    rows: a ``SummaryRow`` per module, the root first.
    collections: the collections the table has a bytes column for, in column order.
    total_params: the parameters of the whole model, each Variable counted once.
    total_bytes: the bytes of the whole model per collection.
    layer_norms: a ``LayerNorms`` per stack; None (the default): none.
    norms: every L2 norm, under the keys ``norms()`` returns; None (the default): none.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> table = sr.summary(sr.nn.Linear(3, 2, rngs=sr.Rngs(0)), jnp.ones((5, 3)))
  >>> table.total_params, table.rows[0].outputs
  (8, ('float32[5,2]',))
  >>> isinstance(table, str), table.splitlines()[2]
  (True, '(root)  Linear       8          32 B  float32[5,2]')
  """

  rows: list[SummaryRow]
  collections: list[str]
  total_params: int
  total_bytes: dict[str, int]
  layer_norms: list[LayerNorms]
  _norms: dict[str, float]

  def __new__(
    cls,
    rows: list[SummaryRow],
    collections: list[str],
    total_params: int,
    total_bytes: dict[str, int],
    layer_norms: list[LayerNorms] | None = None,
    norms: dict[str, float] | None = None,
  ):
    args = (rows, collections, total_params, total_bytes, list(layer_norms or []))
    text = "\n".join(_lines(*args, dict(norms or {})))
    self = super().__new__(cls, text)
    self.rows, self.collections, self.total_params, self.total_bytes, self.layer_norms = args
    self._norms = dict(norms or {})
    return self

  def __reduce__(self):  # pickle and copy rebuild it from its parts, not from the text
    parts = (self.rows, self.collections, self.total_params, self.total_bytes)
    return (type(self), (*parts, self.layer_norms, self._norms))

  def norms(self) -> dict[str, float]:
    """Every L2 norm, levanter's way: ``params/norm/<path>`` for each Param (a stacked
    one once per layer, the layer index after the stack's path:
    ``params/norm/blocks.3.linear.kernel``), ``params/norm/total`` for all Params
    together, and the same under ``grad/norm/`` given ``grads``. Ready for
    ``wandb.log`` or a TensorBoard writer.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> Stack = sr.vmap(sr.nn.Linear, axis_size=2)
    >>> norms = sr.summary(Stack(2, 2, use_bias=False, rngs=sr.Rngs(0))).norms()
    >>> list(norms)
    ['params/norm/0.kernel', 'params/norm/1.kernel', 'params/norm/total']
    """
    return dict(self._norms)

  def lines(self) -> list[str]:
    """The text table as a list of lines (``self.splitlines()``): header, rule, one
    line per row, rule, total; then, for each stack of a pattern, its positions, and
    for each stack, its per-layer norms.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> table = sr.summary(sr.nn.Linear(3, 2, rngs=sr.Rngs(0)), jnp.ones((5, 3)))
    >>> for line in table.lines(): print(line)
    path    class   params  params bytes  output
    --------------------------------------------------
    (root)  Linear       8          32 B  float32[5,2]
    --------------------------------------------------
    Total                8          32 B
    """
    return self.splitlines()

  def __repr__(self) -> str:  # at a prompt, the table itself, not a quoted string
    return str.__str__(self)

  def __treescope_repr__(self, path, subtree_renderer):
    from treescope import rendering_parts as rp

    n = len(self.rows)
    return rp.build_foldable_tree_node_from_children(
      prefix=rp.text(f"Summary(  # {self.total_params:,} params, {n} module{'s' * (n != 1)}"),
      children=[rp.text(line) for line in self.lines()],
      suffix=rp.text(")"),
      path=path,
    )


def _lines(rows, collections, total_params, total_bytes, layer_norms, norms) -> list[str]:
  """The lines of the text of ``Summary(*parts)`` (see ``Summary.lines``)."""
  with_norms = any(r.grad_norm is not None for r in rows)
  header = ["path", "class", "params", *(f"{c} bytes" for c in collections)]
  header += ["params norm", "grads norm"] * with_norms + ["output"]
  body = []
  for r in rows:
    sizes = [_bytes_text(r.bytes.get(c, 0)) or "-" for c in collections]
    norm_cells = [norm_text(r.param_norm), norm_text(r.grad_norm)] * with_norms
    body.append([r.path_text, r.class_name, r.params_text(), *sizes, *norm_cells, r.outputs_text()])
  totals = [norms.get("params/norm/total"), norms.get("grad/norm/total")] * with_norms
  total_sizes = [_bytes_text(total_bytes.get(c, 0)) for c in collections]
  total = ["Total", "", f"{total_params:,}", *total_sizes, *map(norm_text, totals), ""]
  numeric = set(range(2, len(header) - 1))
  lines = columns([header, *body, total], numeric)
  rule = "-" * max(map(len, lines))
  out = [lines[0], rule, *lines[1:-1], rule, lines[-1]]
  for row in rows:
    if row.pattern is None:
      continue
    # The cycle once: each position's stack, and the layers of the whole it holds;
    # before them, what the short labels of a long pattern stand for.
    below = [
      r
      for r in rows
      if r.position is not None
      and len(r.path) == len(row.path) + 2
      and r.path[: len(row.path)] == row.path
    ]
    out += [
      "",
      f"{row.path_text}: {row.class_name}, {row.pattern}",
      *(f"  {line}" for line in row.legend),
      *("  " + line for line in columns([[r.path_text, r.position or ""] for r in below], set())),
    ]
  for stack in layer_norms:
    out += ["", *stack.lines()]
  return out


def summary(model, *example_inputs, method: str = "__call__", grads=None, **kwargs) -> Summary:
  """A table of ``model``'s modules: class, parameter count, bytes per collection and
  the output shapes of a call on ``example_inputs`` (arrays or ``jax.ShapeDtypeStruct``);
  for each stack, the L2 norm of each layer's parameters.

  The call is traced with ``jax.eval_shape`` on a copy, so it computes nothing and the
  model is left as it was (BatchNorm statistics, RNG counts); the norms take one
  reduction per parameter array. Counts cover each module
  and everything below it; stacked modules (scan, remat_scan, vmap) also give their
  layer count and the count of one layer. Each module and Variable is listed once, at
  the path ``sr.state`` gives it (a shared Rngs under the same owner). It is the text
  (a ``str``, as ``nnx.tabulate`` returns): ``print`` it or ``.splitlines()``;
  treescope (and ``sr.display``) draw it too. With no inputs, the output column stays
  empty; an output wider than the column (a dict of many arrays) is cut, keys kept.

  Norms are what one looks at when a deep model diverges, and what levanter logs for
  its scanned stacks: ``grads`` (the ``State`` ``sr.grad`` returns, same paths as
  ``sr.state(model, sr.Param)``) adds a ``grads norm`` column, next to ``params
  norm``, to every row and a gradient column to each stack's per-layer table.
  ``summary.norms()`` has them all as ``params/norm/...`` and ``grad/norm/...``
  (levanter's keys), ``summary.layer_norms`` as arrays. Norms need values: for an
  abstract model (``sr.eval_shape``) there are none.

  Args:
    model: the Module to describe; it is left as it was.
    *example_inputs: the positional arguments of a call (arrays or
      ``jax.ShapeDtypeStruct``), traced to fill the output column; none leaves it empty.
    method: the name of the method to call; ``"__call__"`` by default.
    grads: the gradients of the model's Params (the ``State`` ``sr.grad`` returns), to
      add their norms; None (the default) for none.
    **kwargs: keyword arguments of the call, traced as ``example_inputs`` are.

  Returns:
    A ``Summary``: the text table, a ``str``, that keeps its rows, totals and norms.

  Raises:
    TypeError: ``model`` is not a Module, or ``grads`` is not a State of arrays.
    AttributeError: the model has no method ``method``.
    ValueError: ``grads`` holds a path that is not a Param of the model, or a gradient
      whose shape is not its Param's.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> class MLP(sr.Module):
  ...   def __init__(self, rngs):
  ...     self.hidden = sr.nn.Linear(4, 8, rngs=rngs)
  ...     self.out = sr.nn.Linear(8, 2, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.out(jax.nn.relu(self.hidden(x)))
  >>> print(sr.summary(MLP(sr.Rngs(0)), jnp.ones((16, 4))))
  path    class   params  params bytes  output
  ---------------------------------------------------
  (root)  MLP         58         232 B  float32[16,2]
  hidden  Linear      40         160 B  float32[16,8]
  out     Linear      18          72 B  float32[16,2]
  ---------------------------------------------------
  Total               58         232 B

  A stack of 3 layers (an ensemble: member ``i`` sees ``i * x``), with the gradients
  of a loss:

  >>> class Ensemble(sr.Module):
  ...   def __init__(self, rngs):
  ...     self.members = sr.vmap(sr.nn.Linear, axis_size=3)(
  ...         4, 4, use_bias=False, kernel_init=jax.nn.initializers.ones, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.members(x)
  >>> model = Ensemble(sr.Rngs(0))
  >>> x = jnp.arange(3.0)[:, None, None] * jnp.ones((3, 2, 4))
  >>> grads = sr.grad(lambda m, x: jnp.sum(m(x)))(model, x)
  >>> table = sr.summary(model, x, grads=grads)
  >>> print(table)
  path     class              params  params bytes  params norm  grads norm  output
  -----------------------------------------------------------------------------------------
  (root)   Ensemble      48 (3 × 16)         192 B        6.928       17.89  float32[3,2,4]
  members  Vmap[Linear]  48 (3 × 16)         192 B        6.928       17.89  float32[3,2,4]
  -----------------------------------------------------------------------------------------
  Total                           48         192 B        6.928       17.89
  <BLANKLINE>
  members: Vmap[Linear], 3 layers, L2 norm of each layer's Params and gradients
  layer  params  grads
      0       4      0
      1       4      8
      2       4     16
  >>> table.norms()["grad/norm/members.2.kernel"], table.layer_norms[0].grads.tolist()
  (16.0, [0.0, 8.0, 16.0])
  """
  if not isinstance(model, Module):
    raise TypeError(
      f"sr.summary takes a module, got {type(model).__name__}. Fix: pass the model "
      "first, then example inputs: `sr.summary(model, x)`."
    )
  called = example_inputs or kwargs
  if called and not callable(getattr(model, method, None)):
    raise AttributeError(
      f"sr.summary(..., method={method!r}): {type(model).__name__} has no method "
      f"{method!r}. Fix: name a method the class defines (default `__call__`)."
    )
  description = describe(model)
  outputs = trace_outputs(model, description, example_inputs, method, kwargs) if called else {}
  norms = Norms(description, grads)

  variables = description.variables
  params_first = ["params"] * any(e.is_param for e in variables)
  collections = list(dict.fromkeys(params_first + [e.collection for e in variables]))
  rows = [
    _row(m, variables, outputs.get(m.path, ()), norms, node_at(model, m.path))
    for m in description.modules
  ]
  total_params = sum(e.size for e in variables if e.is_param)
  total_bytes = _bytes_by_collection(variables)
  return Summary(rows, collections, total_params, total_bytes, norms.layer_norms(), norms.flat())


def _row(module: ModuleEntry, variables, outputs, norms: Norms, obj) -> SummaryRow:
  entries = [variables[i] for i in module.variables]
  params = [e for e in entries if e.is_param]
  stacked = [(e.size, e.layers) for e in params if e.layers is not None]
  per_layer = sum(size // layers for size, layers in stacked)
  unstacked = sum(e.size for e in params if e.layers is None)
  # The breakdown only reads right when the row's stacked variables agree on a count.
  counts = {layers for _, layers in stacked}
  n = counts.pop() if len(counts) == 1 else 1
  pattern, position = pattern_text(obj), position_text(obj)
  if pattern is not None:
    n, per_layer, unstacked = len(obj), 0, 0
  return SummaryRow(
    module.path,
    class_text(module.cls),
    sum(e.size for e in params),
    _bytes_by_collection(entries),
    n,
    per_layer if n > 1 else 0,
    unstacked if n > 1 else 0,
    tuple(outputs),
    norms.total(module.variables, norms.params),
    norms.total(module.variables, norms.grads),
    pattern,
    position,
    pattern_names(obj).legend if pattern is not None else (),
  )


def _bytes_by_collection(entries) -> dict[str, int]:
  out: dict[str, int] = {}
  for entry in entries:
    out[entry.collection] = out.get(entry.collection, 0) + entry.nbytes
  return out


def _bytes_text(n: int) -> str:
  if n == 0:
    return ""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n} B"


# -- norms: the L2 norm of each Param (and of its gradient), per layer where it has a
# layer axis. Each array takes one reduction on its device (a sum of squares, per layer
# for a stacked one); the small results come back to the host together.


@dataclasses.dataclass(frozen=True)
class LayerNorms:
  """The L2 norm of each layer's Params of one stack (its stacked Params; the ones it
  broadcasts belong to no layer), and of their gradients when ``sr.summary`` was given
  ``grads`` (else None). ``params[i]`` is the norm of layer ``i``. For the stack of one
  position of a pattern stack, ``stack_layers[i]`` is the number its layer ``i`` has in
  the whole stack (the table shows those numbers); None elsewhere.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Stack = sr.vmap(sr.nn.Linear, axis_size=3)
  >>> norms = sr.summary(Stack(2, 2, rngs=sr.Rngs(0))).layer_norms[0]
  >>> norms.path_text, norms.params.shape, norms.grads
  ('(root)', (3,), None)
  """

  path: tuple
  class_name: str
  params: np.ndarray
  grads: np.ndarray | None = None
  stack_layers: range | None = None

  @property
  def path_text(self) -> str:
    return format_path(self.path) if self.path else "(root)"

  def lines(self, show: int = 32) -> list[str]:
    """A title and one line per layer; past ``show`` layers, the first and last 8,
    and the layers with the largest norms, ``…`` between them."""
    layers, grads = len(self.params), self.grads
    numbers = self.stack_layers if self.stack_layers is not None else range(layers)
    of_stack = ""
    if self.stack_layers is not None:
      of_stack = f" ({layer_numbers(self.stack_layers)} of the pattern stack)"
    title = (
      f"{self.path_text}: {self.class_name}, {layers_text(layers)}{of_stack}, "
      f"L2 norm of each layer's Params{' and gradients' if grads is not None else ''}"
    )
    keep = set(range(layers))
    if layers > show:
      keep = {*range(8), *range(layers - 8, layers), int(np.nanargmax(self.params))}
      if grads is not None:
        keep.add(int(np.nanargmax(grads)))
    header = ["layer", "params", *(["grads"] * (grads is not None))]
    gap = ["…"] + [""] * (len(header) - 1)
    body, last = [], -1
    for i in sorted(keep):
      if i > last + 1:
        body.append(gap)
      norms = [self.params[i]] if grads is None else [self.params[i], grads[i]]
      body.append([str(numbers[i]), *map(norm_text, norms)])
      last = i
    if last < layers - 1:
      body.append(gap)
    return [title, *columns([header, *body], numeric=set(range(len(header))))]


class Norms:
  """Each Param's sum of squares (of its value and its gradient), per layer where it
  has a layer axis: one reduction per array, fetched from the device together. Keyed
  by the Param's position in ``description.variables``."""

  def __init__(self, description: Description, grads):
    self.description = description
    params = [(i, e) for i, e in enumerate(description.variables) if e.is_param]
    by_path = _grads_by_path(grads, params) if grads is not None else None
    sums = {}
    if all(is_concrete(e.variable._value) for _, e in params):
      sums["p"] = {i: squares(e.variable._value, e.layer_axis) for i, e in params}
    if by_path is not None and "p" in sums:
      sums["g"] = {
        i: squares(by_path[e.path], e.layer_axis) for i, e in params if e.path in by_path
      }
    sums = jax.device_get(sums)
    self.params, self.grads = sums.get("p"), sums.get("g")
    # Innermost first: a Variable's stack is the longest stack path above it.
    self.stacks = sorted((m.path for m in description.modules if m.is_stack), key=len, reverse=True)

  def stack_of(self, path: tuple) -> tuple | None:
    return next((s for s in self.stacks if path[: len(s)] == s), None)

  @staticmethod
  def total(variables, sums) -> float | None:
    """The L2 norm of ``variables``' entries in ``sums``; None where it has none."""
    held = [sums[i] for i in variables if i in sums] if sums is not None else []
    if not held:
      return None
    return float(np.sqrt(sum(float(np.sum(x)) for x in held)))

  def layer_norms(self) -> list[LayerNorms]:
    if self.params is None:
      return []
    out = []
    for module in self.description.modules:
      if not module.is_stack:
        continue
      stacked = [i for i in module.stacked if i in self.params]
      lengths = {np.shape(self.params[i]) for i in stacked}
      if len(lengths) != 1:  # no stacked Params, or nested stacks of other lengths
        continue

      def per_layer(sums):
        return np.sqrt(sum(sums[i] for i in stacked if i in sums))

      grads = per_layer(self.grads) if self.grads is not None else None
      params = per_layer(self.params)
      # One position of a pattern stack: its layer i is layer k + i * P of the stack.
      p, k = getattr(stack_info(module.cls), "index_map", (1, 0))
      numbers = range(k, k + p * len(params), p) if p > 1 else None
      out.append(LayerNorms(module.path, class_text(module.cls), params, grads, numbers))
    return out

  def flat(self) -> dict[str, float]:
    out = {}
    for prefix, sums in (("params", self.params), ("grad", self.grads)):
      if sums is None:
        continue
      for i, value in sums.items():  # in the order of `description.variables`
        path = self.description.variables[i].path
        stack = self.stack_of(path) if np.ndim(value) else None
        if stack is None:
          out[f"{prefix}/norm/{_dotted(path)}"] = float(np.sqrt(np.sum(value)))
          continue
        for n, sq in enumerate(value):
          key = _dotted(path[: len(stack)] + (n,) + path[len(stack) :])
          out[f"{prefix}/norm/{key}"] = float(np.sqrt(sq))
      out[f"{prefix}/norm/total"] = float(np.sqrt(sum(float(np.sum(x)) for x in sums.values())))
    return out


def _grads_by_path(grads, params) -> dict[tuple, Any]:
  """``grads`` (a State, as ``sr.grad`` returns) by path, checked against the Params."""
  flat = getattr(grads, "flat", None)
  if not callable(flat):
    raise TypeError(
      f"sr.summary(..., grads=...) takes the State sr.grad returns, got "
      f"{type(grads).__name__}. Fix: `grads = sr.grad(loss)(model, x)`, then "
      "`sr.summary(model, grads=grads)`."
    )
  shapes = {e.path: np.shape(e.variable._value) for _, e in params}
  flat_grads = flat()
  if not isinstance(flat_grads, dict):
    raise TypeError(
      f"sr.summary(..., grads=...): `grads.flat()` gave a {type(flat_grads).__name__}, "
      "not a dict of paths to arrays. Fix: pass the State sr.grad returns."
    )
  for path, g in flat_grads.items():
    if path not in shapes:
      raise ValueError(
        f"sr.summary(..., grads=...): `{format_path(path)}` is not a Param of this "
        "model. Fix: pass the gradients of this model's Params, as "
        "`sr.grad(loss)(model, x)` gives them."
      )
    if np.shape(g) != shapes[path]:
      raise ValueError(
        f"sr.summary(..., grads=...): the gradient at `{format_path(path)}` has shape "
        f"{np.shape(g)}, the Param {shapes[path]}. Fix: pass the gradients of this "
        "model, taken at its current structure."
      )
  return flat_grads


def _dotted(path: tuple) -> str:
  return ".".join(map(str, path))


def columns(table: list[list[str]], numeric: set[int]) -> list[str]:
  """Each row's cells padded to their column's width: numbers to the right."""
  widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
  return [
    "  ".join(
      c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()
    for cells in table
  ]


def norm_text(x) -> str:
  return "-" if x is None else f"{float(x):.4g}"

"""``sr.summary``: a table of a model's modules — class, parameter count, bytes per
collection and output shapes — traced with ``jax.eval_shape``, so nothing is computed;
for each stack, the L2 norm of each layer's parameters (and of their gradients, given
``grads``), as levanter logs them for its scanned stacks.

Every module and Variable is listed once, at the path ``sr.state`` gives it: a shared
one (an Rngs handed to several layers) under the owner the GraphDef's sorted walk
reaches first, wherever the definition order meets it first.

The parts run one way: ``_summary_walk`` walks the model once into a ``Description``;
``_summary_norms`` (the norms) and ``_summary_outputs`` (output shapes, caught while
tracing) read that description; this file puts the table together. None walks the
model again, and none imports the file above it.
"""

from __future__ import annotations

import dataclasses

from ..core._errors import format_path
from ..core._module import Module
from ..core._split_merge import node_at
from ._pattern_names import pattern_names
from ._repr import class_text, layers_text, pattern_text, position_text
from ._summary_norms import LayerNorms as LayerNorms
from ._summary_norms import Norms, columns, norm_text
from ._summary_outputs import OUTPUT_WIDTH, shorten, trace_outputs
from ._summary_walk import ModuleEntry, describe


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


def _lines(
  rows: list[SummaryRow],
  collections: list[str],
  total_params: int,
  total_bytes: dict[str, int],
  layer_norms: list[LayerNorms],
  norms: dict[str, float],
) -> list[str]:
  """The lines of ``Summary``'s text (see ``Summary.lines``)."""
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

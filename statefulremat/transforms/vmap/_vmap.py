"""sr.vmap: ``jax.vmap`` over modules — stacked init and vectorised application."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack, cast, overload

import jax
import jax.core
import jax.numpy as jnp
from jax import lax

from ...core._bookkeeping import is_bookkeeping
from ...core._errors import format_path
from ...core._filters import filter_repr
from ...core._frozen import ALL_SPLIT, ALL_STACKED, EMPTY
from ...core._module import Module
from ...core._pattern_stack import PatternStack
from ...core._stacks import Form, cycle, is_stacked, layer_axis
from ...core._variables import release_owner
from .._class_form import (
  M,
  P,
  R,
  Transform,
  cached_class_form,
  display_name,
  fresh,
  function_target,
)
from .._lift import commit, is_node, serialised, split_call
from .._module_arg import (
  check_no_modules,
  class_length,
  lift_module_arg,
  resolve_length,
  stacked_sources,
)
from .._outputs import ModulesOut, Restructured
from .._pattern import check_positions, class_form, position_names, target_repr
from .._rules import STACKED, Collections, Rules, StackOptions, TransformError, public
from ._outputs import check_returned_inputs, leaf_axes, stacked_outputs, vmap_creating


class _DefaultAxis(int):
  """``in_axes``'s default 0, told apart from an explicit 0, which maps the module too."""


_DEFAULT_IN_AXES = _DefaultAxis(0)


class _Options(StackOptions, total=False):
  """The keywords of ``vmap``, for its overloads (the implementation gives the defaults)."""

  in_axes: Any
  out_axes: Any
  axis_size: int | None
  axis_name: str | None


# The class form: a stack of M, typed as M (`stack.layer(i)` is an M).
@overload
def vmap(target: type[M], **options: Unpack[_Options]) -> type[M]: ...
@overload  # a pattern stack, whose positions differ
def vmap(
  target: Sequence[type[Module] | functools.partial[Any]], **options: Unpack[_Options]
) -> type: ...
@overload  # the function form: the same signature
def vmap(target: Callable[P, R], **options: Unpack[_Options]) -> Callable[P, R]: ...
@overload  # keywords only: a decorator of a class or a function
def vmap(target: None = None, **options: Unpack[_Options]) -> Transform: ...
@cached_class_form
def vmap(
  target: Callable | type | Sequence[Callable] | None = None,
  *,
  in_axes: Any = _DEFAULT_IN_AXES,
  out_axes: Any = 0,
  axis_size: int | None = None,
  axis_name: str | None = None,
  variable_axes: Mapping[Any, Any] = ALL_STACKED,
  split_rngs: Mapping[Any, Any] = ALL_SPLIT,
  variable_broadcast: Any = False,
  metadata_params: Mapping[Any, Any] = EMPTY,
  methods: Sequence[str] | None = None,
  init_in_axes: Any = None,
):
  """``jax.vmap`` over a module: ``vmap(f)(module, *args)``; or a stacked init.

  Args:
    target: a function ``f(module, *args, **kwargs)`` (also a method, or ``__init__``), a Module
      class (the class form), or a tuple of classes (a pattern); ``None`` makes a decorator.
    in_axes: where each non-module positional argument is mapped, as in ``jax.vmap``
      (default ``0``; ``None`` broadcasts). An explicit one covers the module argument
      as nnx's does: ``sr.vmap(f, in_axes=(None, 0))(model, xs)``.
    out_axes: where the mapped axis goes in each output (default ``0``); for a returned
      module, its Variables' layer axis.
    axis_size: the size of the mapped axis where nothing else tells it; for the class
      form, the number of layers. Default ``None``.
    axis_name: a name for the mapped axis, for collectives inside (default ``None``).
    variable_axes: ``{filter: axis}``, the variables mapped and their axis (default
      ``{True: 0}``: a stack's Variables; a plain module's raise).
    split_rngs: ``{stream filter: bool}``, the RNG streams that give each layer its key
      (default ``{True: True}``: every stream).
    variable_broadcast: filter of the variables every layer sees whole (default
      ``False``); ``True`` applies one module per example.
    metadata_params: ``{"partition_name": name}``, the layer axis's name in the
      ``sharding`` metadata of the mapped variables, as ``sr.scan``'s. Default ``{}``.
    methods: for a class target, the methods to map (default ``None``: ``__call__``).
    init_in_axes: for a class target, the constructor arguments that differ per member,
      as ``sr.scan``'s (default ``None``: every argument whole); without
      ``axis_size``, it tells the number of members.

  Returns:
    For a function, a function of the same arguments that maps it and writes its
    changes back to the module passed in; for a class (or a pattern), the stack class
    ``Vmap{Name}`` (one per equal arguments); with no ``target``, a decorator.

  Raises:
    sr.TransformError: ``in_axes`` / ``out_axes`` that do not fit; no way to tell the mapped size; a
      constructor failing on an array passed whole that one slice would suit; the default
      ``variable_axes`` meeting a plain module's Variables; a write to an unmapped variable that
      depends on the mapped axis; a variable matched by two rules.
    TypeError: a ``target`` that is not callable; ``methods`` / ``init_in_axes`` with a
      function; ``variable_axes`` that is not ``{filter: int}``.
    sr.GraphError: a module in an argument after argument 0 or in a keyword argument.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Ensemble = sr.vmap(sr.nn.Linear, axis_size=5, in_axes=None)
  >>> ensemble = Ensemble(3, 2, rngs=sr.Rngs(0))
  >>> ensemble.kernel.shape, ensemble(jnp.ones((4, 3))).shape
  ((5, 3, 2), (5, 4, 2))
  >>> linear = sr.nn.Linear(3, 2, rngs=sr.Rngs(0))      # one module, per example:
  >>> sr.vmap(lambda m, x: m(x), variable_broadcast=True)(linear, jnp.ones((4, 3))).shape
  (4, 2)
  """
  explicit_axes = type(in_axes) is not _DefaultAxis
  collections = Collections(variable_axes, variable_broadcast, split_rngs=split_rngs)
  options: dict[str, Any] = dict(
    in_axes=in_axes if explicit_axes else 0,
    out_axes=out_axes,
    axis_size=axis_size,
    axis_name=axis_name,
    collections=collections,
    metadata_params=metadata_params,
  )
  if target is None:
    given = {**public(options), "in_axes": in_axes}  # the default stays the default
    return functools.partial(vmap, methods=methods, init_in_axes=init_in_axes, **given)

  made = class_form(
    target,
    Form.VMAP,
    what=f"sr.vmap({target_repr(target)})",
    rules=lambda: Rules(f"sr.vmap({target_repr(target)})", collections),
    count=lambda _: axis_size,
    # A class form's methods map their stack by its rules, never by in_axes.
    run=lambda fn, _: _vmap_function(fn, {**options, "axis_size": None}, False),
    position_class=lambda cls, n: fresh(vmap)(
      cls, **{**public(options), "axis_size": n}, methods=methods, init_in_axes=init_in_axes
    ),
    methods=methods,
    metadata_params=metadata_params,
    init_in_axes=init_in_axes,
  )
  if made is not None:
    return made
  fn = function_target(
    "sr.vmap",
    target,
    takes="a function, a Module class or a tuple of classes (a pattern)",
    methods=methods,
    init_in_axes=init_in_axes,
  )
  if getattr(fn, "__name__", None) == "__init__":
    return _vmapped_init(fn, public(options))
  # nnx's in_axes cover the module argument: an explicit one says how its Variables map.
  covers = variable_axes is ALL_STACKED and variable_broadcast is False
  return _vmap_function(fn, options, covers and explicit_axes)


def _vmap_function(fn: Callable, options: dict, covers_module: bool):
  """The function form over ``fn``; ``options``: ``vmap``'s, with its ``collections``."""
  in_axes, out_axes, axis_size = options["in_axes"], options["out_axes"], options["axis_size"]
  axis_name, metadata_params = options["axis_name"], options["metadata_params"]
  collections = options["collections"]
  what = f"sr.vmap({display_name(fn)})"
  rules = Rules(what, collections)

  @functools.cache
  def rules_for(module_axis) -> Rules:
    """The module argument's Rules by its ``in_axes`` entry: that axis, or None broadcasts."""
    axes = {} if module_axis is None else {True: module_axis}
    return Rules(what, Collections(axes, module_axis is None, split_rngs=collections.split_rngs))

  mapping = {k: v for k, v in options.items() if k != "collections"}
  creating = functools.partial(vmap_creating, fn, stack_class=_stack_class, what=what, **mapping)

  @functools.wraps(fn)
  def wrapper(module, *args, **kwargs):
    check_no_modules(args, what, "argument", first=1)
    check_no_modules(kwargs, what, "the keyword argument")
    call_rules, call_axes = rules, in_axes
    by_default = collections.variable_axes is ALL_STACKED
    # As nnx reads an explicit in_axes: one entry more maps the module; an int, a plain one.
    if covers_module and isinstance(in_axes, (tuple, list)) and len(in_axes) == len(args) + 1:
      call_rules, call_axes, by_default = rules_for(in_axes[0]), type(in_axes)(in_axes[1:]), False
    elif covers_module and isinstance(in_axes, int) and not _holds_stack(module):
      call_rules, by_default = rules_for(in_axes), False
    # A pattern stack's unit is one cycle of its P classes (``padded`` and after).
    positions = cycle(module) if isinstance(module, Module) else (module,)
    period = len(positions)
    target = positions if period > 1 else module
    lifted, variables, treatment, leaves = lift_module_arg(
      target, what, call_rules, metadata_params, "f(module, *args)", pattern=period > 1
    )
    values = [v._value for v in variables]
    stacked = treatment.indices(STACKED)
    arg_axes = call_axes if isinstance(call_axes, (tuple, list)) else (call_axes,) * len(args)
    if len(arg_axes) != len(args):
      raise TransformError(
        f"{what}: in_axes={call_axes!r} has {len(arg_axes)} entries for "
        f"{len(args)} arguments (the module excluded). Fix: one entry per argument after "
        "the module, or, as nnx writes it, one more whose first entry maps the module "
        "(an axis, or None to broadcast it)."
      )
    if by_default:
      refuse_mapping_plain(what, lifted, treatment, variables, stacked)
    names: list[str] = []
    if period > 1:
      names = position_names(cast(PatternStack, module))
      members = sum(check_positions(cast(PatternStack, module), what))
      sources = [("the pattern stack's members", members)]
    else:
      sources = stacked_sources(treatment, lifted, variables)
    for j, (a, ax) in enumerate(zip(args, arg_axes)):
      if isinstance(ax, int):
        for leaf in jax.tree.leaves(a):
          if not -jnp.ndim(leaf) <= ax < jnp.ndim(leaf):
            raise TransformError(
              f"{what}: in_axes puts the mapped axis of argument {j + 1} at {ax}, but a "
              f"leaf has shape {tuple(jnp.shape(leaf))}. Fix in_axes (None broadcasts)."
            )
          sources.append((f"argument {j + 1} (axis {ax})", jnp.shape(leaf)[ax]))
    if axis_size is not None:
      sources.insert(0, (f"axis_size={axis_size}", int(axis_size)))
    if not sources and (stack_length := class_length(module)) is not None:
      sources.append(("the stack's axis_size", stack_length))
    if not sources:
      raise TransformError(
        f"{what}: cannot tell the size of the mapped axis: no argument is mapped "
        "(in_axes is None for all) and no variable is stacked. Pass `axis_size=`."
      )
    n = resolve_length(what, sources)
    cycles = -(-n // period)
    counts = {s.count for s in treatment.streams}
    isolate = []  # a pattern's shared Variables: each position writes its own copy
    if period > 1:
      streams = {i for s in treatment.streams for i in (s.key, s.count)}
      isolate = [i for i, k in enumerate(treatment.kinds) if k != STACKED and i not in streams]
    used: set[int] = set()

    def one(stacked_values, index, call_args):
      flat = list(values)
      for i, value in zip(stacked, stacked_values):
        flat[i] = value

      def call(module, call_args=call_args):
        out = fn(module, *call_args, **kwargs)
        check_returned_inputs(what, out, out_axes, module, treatment, values)
        return out

      out, changes = lifted.run(
        call if period == 1 else lambda k, positions: call(positions[k], call_args[k]),
        flat,
        leaves,
        what,
        seed=(treatment, index if period == 1 else index * jnp.uint32(period)),
        units=range(period) if period > 1 else None,
        isolate=isolate,
        restructure=True,
        outputs=True,
      )
      if period > 1:
        out = stack_units(what, out, names)
      if changes.structure is not None:
        record["structure"] = changes.structure
      changed, made = changes.values, changes.made
      used.update(i for i in changed if i in counts)
      shared = {i: changed[i] for i in changed if i not in counts and i not in stacked}
      for i in sorted({i for unit in changes.isolated for i in unit}):
        shared[i] = jnp.stack([unit.get(i, values[i]) for unit in changes.isolated])
      record["shared"] = sorted(shared)
      return out, {i: changed[i] for i in stacked if i in changed}, shared, made

    record: dict = {}
    if period == 1:
      stacked_in = [values[i] for i in stacked]
      mapped_args, args_axes, outs_axes = args, tuple(arg_axes), out_axes
    else:
      stacked_in = [padded(values[i], treatment.stacked_axis(i), cycles) for i in stacked]
      mapped_args = position_args(args, arg_axes, period, cycles)
      # The cycle axis in front of every mapped output.
      outs_axes = jax.tree.map(
        lambda a: a if a is None else 0, out_axes, is_leaf=lambda a: a is None
      )
      args_axes = (tuple(arg_axes),) * period
    # A write to a Variable that is not mapped is kept when its value does not depend
    # on the mapped axis (the same for every index, as nnx's guide's `count += 1`):
    # out_axes=None, which JAX refuses for a value that varies along the axis.
    mapped = jax.vmap(
      one,
      in_axes=([treatment.axes[i] for i in stacked], 0, args_axes),
      out_axes=(outs_axes, 0, None, 0),
      axis_size=cycles,
      axis_name=axis_name,
    )
    try:
      out, written, shared, made = mapped(
        stacked_in, jnp.arange(cycles, dtype=jnp.uint32), mapped_args
      )
    except ValueError as e:
      if not record.get("shared") or "out_axes" not in str(e):
        raise
      refuse_shared_write(what, lifted, variables, record["shared"])
    treatment.check_stream_names()
    structure = record.get("structure")
    if period > 1:
      for i in isolate:
        if i in shared:
          agree(shared[i], functools.partial(refuse_shared_write, what, lifted, variables, [i]))
          shared[i] = shared[i][0]
      out = member_order(out, out_axes, n)
      # The padded members of the short last cycle are dropped.
      written = {
        i: v[: jnp.shape(values[i])[treatment.stacked_axis(i)]] for i, v in written.items()
      }
      if made and n % period:
        raise TransformError(
          f"{what}: a member made a Variable (e.g. `self.sow(...)`) inside a pattern stack of "
          f"{n} members, which is not a multiple of its pattern of {period}: the positions "
          "would hold it for different numbers of members. Nothing was written. Fix: a number "
          f"of members that is a multiple of {period}, or create the Variable in `__init__`."
        )
    changed = {i: jnp.moveaxis(v, 0, treatment.stacked_axis(i)) for i, v in written.items()}
    changed |= shared
    with_modules = structure is not None or type(out) is ModulesOut
    nodes = split_call((target,), {})[0] if with_modules else ()
    commit(
      variables,
      changed,
      what,
      None if structure is None else Restructured(None, made, structure),
      nodes=nodes,
      streams=used,
      stacked_axis=0,  # a Variable made inside comes out stacked
      partition_name=(metadata_params or {}).get("partition_name"),
      keep_metadata=True,
    )
    if type(out) is ModulesOut:
      out = stacked_outputs(what, out, n, _stack_class, metadata_params, out_axes).rebuild(nodes)
    return out

  compiled = serialised(wrapper)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if not _holds_node((args, kwargs)):  # as nnx's `init_vmap()`: it builds modules
      return creating(args, kwargs)
    return compiled(*args, **kwargs)

  return call


def _vmapped_init(init: Callable, options: dict) -> Callable:
  """``@sr.vmap(in_axes=(None, 0))`` on ``__init__``: ``self`` takes a stack's attributes,
  its members built by the undecorated ``__init__`` (``self``'s ``in_axes`` is ignored)."""
  in_axes = options["in_axes"]

  @functools.wraps(init)
  def wrapper(self, *args, **kwargs):
    cls = type(self)
    axes = list(in_axes[1:]) if isinstance(in_axes, (tuple, list)) else [in_axes] * len(args)
    nodes = {
      "args": {j: a for j, a in enumerate(args) if _holds_node(a)},
      "kwargs": {k: v for k, v in kwargs.items() if _holds_node(v)},
    }
    has_nodes = bool(nodes["args"] or nodes["kwargs"])
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in nodes["kwargs"]}
    rest = [j for j in range(len(args)) if j not in nodes["args"]]

    def build(*call):
      node_tree, plain = (call[0], call[1:]) if has_nodes else (nodes, call)
      full = {**node_tree["args"], **dict(zip(rest, plain))}
      member = object.__new__(cls)
      init(member, *[full[j] for j in range(len(args))], **plain_kwargs, **node_tree["kwargs"])
      return member

    mapped_axes = tuple(axes[j] for j in rest) if len(axes) == len(args) else in_axes
    node_arg = (nodes,) if has_nodes else ()
    call_options: dict[str, Any] = {**options, "in_axes": mapped_axes}
    stack = vmap(build, **call_options)(*node_arg, *[args[j] for j in rest])
    for k, v in list(vars(stack).items()):
      if not is_bookkeeping(k):
        release_owner(v, stack)
        setattr(self, k, v)

  return wrapper


def _stack_class(cls: type, n: int, axis: int = 0) -> type:
  """The class of a module built under ``sr.vmap``: ``sr.vmap(cls, axis_size=n, in_axes=None)``."""
  if is_stacked(cls):  # a stack made per member: stays as it is
    return cls
  rules: dict[str, Any] = {} if axis == 0 else {"variable_axes": {True: axis}}
  return vmap(cls, axis_size=n, in_axes=None, **rules)


def _holds_stack(module) -> bool:
  return any(
    isinstance(node, Module) and is_stacked(node)
    for node in jax.tree.leaves(module, is_leaf=is_node)
  )


def _holds_node(tree) -> bool:
  return any(map(is_node, jax.tree.leaves(tree, is_leaf=is_node)))


def refuse_mapping_plain(what, lifted, treatment, variables, stacked) -> None:
  """Raises if the default ``variable_axes`` would map a Variable with no layer axis."""
  for i in stacked:
    var = variables[i]
    if layer_axis(var) is not None:
      continue
    path = format_path(treatment.display_path(lifted.graphdef.var_paths[i]))
    kind = filter_repr(type(var))
    raise TransformError(
      f"{what}: `{path}` ({type(var).__name__}, shape {tuple(jnp.shape(var._value))}) belongs to a "
      "plain module and carries no layer axis, but the default variable_axes="
      "{True: 0} would map its axis 0 alongside the inputs, giving each example one "
      "slice of it. Nothing was run. Fix: to apply the same module to every example, "
      "pass `variable_broadcast=True` (read-only; or e.g. "
      f"`variable_broadcast={kind}`); for an ensemble of independently initialised "
      "modules, build it with the class form (`sr.vmap(Block, axis_size=n)(...)`) or "
      "`sr.stack(layers)`; to map this variable on purpose, give the rule explicitly "
      f"(`variable_axes={{{kind}: 0}}`)."
    )


def refuse_shared_write(what, lifted, variables, written) -> None:
  names = []
  for i in written:
    var = variables[i]
    path = var.path_str() or format_path(lifted.graphdef.var_paths[i])
    names.append(f"`{path}` ({type(var).__name__}, collection {var.collection!r})")
  var = variables[written[0]]
  also = f" (it also wrote to {', '.join(names[1:])})" if len(names) > 1 else ""
  raise TransformError(
    f"{what}: the function wrote to {names[0]}, which is not mapped (broadcast or "
    f"matched by no rule){also}, and a value written depends on the mapped axis, so "
    "each layer's write may differ. Nothing was written. (A write that does not depend "
    "on it, e.g. a step counter, is kept: the caller sees the one value.) Fix: map it "
    "with "
    f"`variable_axes={{{var.collection!r}: 0}}`, or write a value that does not "
    "depend on the mapped inputs."
  ) from None


# A pattern stack: moving between members (the user's layout) and cycles (the map's; README.md).


def padded(value, axis: int, size: int):
  """``value`` with ``size`` entries along ``axis``: extra entries copy entry 0."""
  have = jnp.shape(value)[axis]
  if have == size:
    return value
  fill = jnp.repeat(lax.slice_in_dim(value, 0, 1, axis=axis), size - have, axis=axis)
  return lax.concatenate([value, fill], axis % jnp.ndim(value))


def position_args(args, arg_axes, period: int, cycles: int) -> tuple:
  """Per position ``k``, slices ``k, k + P, ...`` of each mapped argument; the others whole."""

  def slices(k: int):
    take = jnp.arange(k, cycles * period, period)
    return tuple(
      a
      if ax is None
      else jax.tree.map(lambda x, ax=ax: jnp.take(padded(x, ax, cycles * period), take, ax), a)
      for a, ax in zip(args, arg_axes)
    )

  return tuple(slices(k) for k in range(period))


def stack_units(what: str, outs: list, names) -> Any:
  """One cycle's outputs (one per position) as one, the positions in front."""
  first = jax.tree.structure(outs[0])
  for k, out in enumerate(outs[1:], 1):
    if jax.tree.structure(out) != first:
      raise TransformError(
        f"{what}: the members' outputs differ in structure: position 0 ({names[0]}) "
        f"returns {first}, position {k} ({names[k]}) {jax.tree.structure(out)}. Every "
        "class of a pattern must return outputs of one structure to be mapped together."
      )
  return jax.tree.map(lambda *per: jnp.stack(per), *outs)


def member_order(out, out_axes, n: int) -> Any:
  """The map's ``(cycles, P, ...)`` outputs as ``n`` members along each leaf's ``out_axes``."""
  leaves, treedef = jax.tree.flatten(out)
  axes = [axis for _, _, axis in leaf_axes(out_axes, out)]
  result = []
  for leaf, axis in zip(leaves, axes):
    if axis is None:
      result.append(leaf[0])
      continue
    shape = jnp.shape(leaf)
    members = lax.reshape(leaf, (shape[0] * shape[1],) + shape[2:])[:n]
    result.append(jnp.moveaxis(members, 0, axis))
  return jax.tree.unflatten(treedef, result)


def agree(per_position, refuse) -> None:
  """Calls ``refuse()`` unless the positions' values (stacked in front) are one, at run time."""

  def check(stacked):
    if not bool(jnp.all(stacked == stacked[:1])):
      refuse()

  if isinstance(per_position, jax.core.Tracer):
    jax.debug.callback(check, per_position)
  else:
    check(per_position)

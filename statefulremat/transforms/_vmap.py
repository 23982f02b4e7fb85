"""sr.vmap: ``jax.vmap`` over modules — stacked init and vectorised application."""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from ..core._errors import format_path
from ..core._filters import filter_repr
from ..core._graph import _NODE, flatten, rewrite, unflatten
from ..core._module import Module
from ..core._stacks import layer_axis, mark_frozen
from ..core._variables import Variable
from ..core._tracing import tracing_user_code
from ._class_form import display_name, is_module_class, refuse_init_axes
from ._lift import is_node, split_call, write_back
from ._outputs import ModulesOut, lift_outputs
from ._restructure import split_new
from ._rules import STACKED, Rules, TransformError
from ._module_arg import (check_no_modules, class_length, compiled_when_eager, lift_module_arg,
                          resolve_length, stacked_sources)
from ._pattern import call_method, is_pattern, is_pattern_stack, pattern_class, pattern_repr
from ._pattern_vmap import vmap_pattern
from ._stacked import stacked_class

_ALL = MappingProxyType({True: 0})
_SPLIT_ALL = MappingProxyType({True: True})


def vmap(target: Callable | type | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         axis_size: int | None = None, axis_name: str | None = None,
         variable_axes: Mapping = _ALL, split_rngs: Mapping = _SPLIT_ALL,
         variable_broadcast: Any = False, metadata_params: Mapping = MappingProxyType({}),
         methods: Sequence[str] | None = None, init_in_axes: Any = None):
  """``jax.vmap`` over a module: ``vmap(f)(module, *args)``; or a stacked init.

  Function form: equivalent to ``stack([f(layer_i, *args_i) for i ...])`` where
  ``layer_i`` holds slice ``i`` of each variable matched by ``variable_axes`` (default:
  every variable not broadcast), and the same value of each broadcast one. ``in_axes`` /
  ``out_axes`` describe the non-module positional arguments and the outputs, as in
  ``jax.vmap``; keyword arguments pass unmapped to every layer (e.g. Python flags).
  Under the default ``variable_axes`` only a stack's Variables (those carrying a layer
  axis) are mapped: a plain module's parameters raise rather than hand each example
  one slice of them. Per-example use of one module is ``variable_broadcast=True``;
  explicit ``variable_axes`` map what they name.

  Class form: ``sr.vmap(Block, axis_size=8)(*args, rngs=...)`` builds 8 independently
  initialised layers (an ensemble) in one traced init (``init_in_axes`` maps positional
  constructor arguments per member, as ``sr.scan``'s); calling it maps ``methods``
  (default ``__call__``) over the layers, the call's arguments by ``in_axes``.

  A function that takes no module (``sr.vmap(lambda key: Block(rngs=sr.Rngs(key)))(
  keys)``) is ``jax.vmap`` over its arguments (with none, ``sr.vmap(f, axis_size=n)()``
  builds ``n``), and the modules it returns come out as stacks: each Variable with the
  mapped axis where ``out_axes`` puts it (default in front), marked as the layer axis,
  each returned module of the stacked class ``sr.vmap(Block, axis_size=n,
  in_axes=None)``, so ``stack.layer(i)``, ``sr.unstack`` and scanning over it work.
  A module of argument 0 that the function returns comes back as the caller's own
  object: an ``out_axes`` other than its ``variable_axes`` there raises. Decorating
  ``__init__`` (``@sr.vmap(in_axes=(None, 0))``, nnx's guide) builds such a stack
  from the mapped constructor arguments (``self`` is argument 0, never mapped).

  Attributes the function adds to its module argument come out stacked (one per
  layer), as do modules made inside. A write to a Variable that is not mapped is
  kept when its value does not depend on the mapped axis (a step counter), else
  raises.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> Ensemble = sr.vmap(sr.nn.Linear, axis_size=5, in_axes=None)
  >>> ensemble = Ensemble(3, 2, rngs=sr.Rngs(0))
  >>> ensemble.kernel.shape, ensemble(jnp.ones((4, 3))).shape
  ((5, 3, 2), (5, 4, 2))
  >>> linear = sr.nn.Linear(3, 2, rngs=sr.Rngs(0))      # one module, per example:
  >>> sr.vmap(lambda m, x: m(x), variable_broadcast=True)(linear, jnp.ones((4, 3))).shape
  (4, 2)
  """
  options = dict(in_axes=in_axes, out_axes=out_axes, axis_size=axis_size,
                 axis_name=axis_name, variable_axes=variable_axes, split_rngs=split_rngs,
                 variable_broadcast=variable_broadcast, metadata_params=metadata_params)
  if target is None:
    return functools.partial(vmap, methods=methods, init_in_axes=init_in_axes, **options)
  what = f"sr.vmap({pattern_repr(target) if is_pattern(target) else display_name(target)})"
  rules = Rules(what, variable_axes=variable_axes, variable_broadcast=variable_broadcast,
                variable_carry=False, split_rngs=split_rngs)
  if is_pattern(target):
    return pattern_class(
        target, "Vmap", length=axis_size, what=what, methods=methods,
        init_in_axes=init_in_axes,
        position_class=lambda cls, n: vmap(cls, **{**options, "axis_size": n},
                                           methods=methods, init_in_axes=init_in_axes),
        run=lambda name: vmap(call_method(name, "VmapPattern"), **{**options, "axis_size": None}))
  if is_module_class(target):
    return stacked_class(target, "Vmap", rules=rules, length=axis_size,
                         wrap=lambda m: vmap(m, **{**options, "axis_size": None}),
                         methods=methods,
                         metadata_params=metadata_params, init_in_axes=init_in_axes)
  if methods is not None:
    raise TypeError("sr.vmap(methods=...) applies to a Module class, not a function.")
  refuse_init_axes("sr.vmap", target, init_in_axes)
  if getattr(target, "__name__", None) == "__init__":
    return _vmapped_init(target, options)
  return _vmap_function(target, what=what, rules=rules, **options)


def _vmap_function(fn: Callable, *, what, rules, in_axes, out_axes, axis_size, axis_name,
                   variable_axes, split_rngs, variable_broadcast, metadata_params):

  @functools.wraps(fn)
  def wrapper(module, *args, **kwargs):
    if not any(map(is_node, jax.tree.leaves((module, args, kwargs), is_leaf=is_node))):
      return _vmap_creating(fn, (module,) + args, kwargs, what=what, in_axes=in_axes,
                            out_axes=out_axes, axis_size=axis_size, axis_name=axis_name,
                            metadata_params=metadata_params)
    check_no_modules(args, what, "argument", first=1)
    check_no_modules(kwargs, what, "the keyword argument")
    if is_pattern_stack(module):
      return vmap_pattern(module, fn, args, kwargs, what=what, rules=rules, in_axes=in_axes,
                          out_axes=out_axes, axis_size=axis_size, axis_name=axis_name,
                          metadata_params=metadata_params)
    lifted, variables, plan, leaves = lift_module_arg(
        module, what, rules, metadata_params, "f(module, *args)")
    values = [v._value for v in variables]
    stacked = plan.indices(STACKED)
    if variable_axes is _ALL:
      _refuse_mapping_plain(what, lifted, plan, variables, stacked)
    arg_axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(arg_axes) != len(args):
      raise TransformError(f"{what}: in_axes={in_axes!r} has {len(arg_axes)} entries for "
                           f"{len(args)} arguments (the module excluded).")
    sources = stacked_sources(plan, lifted, variables)
    for j, (a, ax) in enumerate(zip(args, arg_axes)):
      if isinstance(ax, int):
        for leaf in jax.tree.leaves(a):
          if not -jnp.ndim(leaf) <= ax < jnp.ndim(leaf):
            raise TransformError(
                f"{what}: in_axes puts the mapped axis of argument {j + 1} at {ax}, but a "
                f"leaf has shape {tuple(jnp.shape(leaf))}. Fix in_axes (None broadcasts).")
          sources.append((f"argument {j + 1} (axis {ax})", jnp.shape(leaf)[ax]))
    if axis_size is not None:
      sources.insert(0, (f"axis_size={axis_size}", int(axis_size)))
    if not sources and class_length(module) is not None:
      sources.append(("the stack's axis_size", class_length(module)))
    if not sources:
      raise TransformError(
          f"{what}: cannot tell the size of the mapped axis: no argument is mapped "
          "(in_axes is None for all) and no variable is stacked. Pass `axis_size=`.")
    n = resolve_length(what, None, sources)
    used: set[int] = set()

    def one(stacked_values, index, call_args):
      flat = list(values)
      for i, value in zip(stacked, stacked_values):
        flat[i] = value
      served = plan.seed_layer(flat, values, index)
      with tracing_user_code(what):
        tree, rebuilt, roots = lifted.rebuild(flat, leaves)
        plan.serve_names(served, rebuilt, index)
        out = fn(tree[0][0], *call_args, **kwargs)
        _check_returned_inputs(what, out, out_axes, rebuilt, plan, values)
        # Modules made inside and returned come out stacked (after the call).
        out = lift_outputs(out, roots, len(flat))
      structure: list = []
      changed = lifted.collect(roots, flat, what, structure)
      if structure:
        record["structure"] = structure[0]
      changed, made = split_new(changed)
      counts = {s.count for s in plan.streams}
      shared = {}
      for i in changed:
        if i in counts:
          used.add(i)
        elif plan.kinds[i] != STACKED:
          shared[i] = changed[i]
      record["shared"] = sorted(shared)
      return out, {i: changed[i] for i in stacked if i in changed}, shared, made

    record: dict = {}
    stacked_in = [values[i] for i in stacked]
    # A write to a Variable that is not mapped is kept when its value does not depend
    # on the mapped axis (the same for every index, as nnx's guide's `count += 1`):
    # out_axes=None, which JAX refuses for a value that varies along the axis.
    mapped = jax.vmap(one, in_axes=([plan.axes[i] for i in stacked], 0, tuple(arg_axes)),
                      out_axes=(out_axes, 0, None, 0), axis_size=n, axis_name=axis_name)
    try:
      out, written, shared, made = mapped(stacked_in, jnp.arange(n, dtype=jnp.uint32),
                                          args)
    except ValueError as e:
      if not record.get("shared") or "out_axes" not in str(e):
        raise
      _refuse_shared_write(what, lifted, variables, record["shared"])
    plan.check_stream_names()
    changed = {i: jnp.moveaxis(v, 0, plan.axes[i]) for i, v in written.items()}
    changed.update(shared)
    for i in used:
      changed[i] = values[i] + jnp.uint32(1)
    write_back(variables, changed, what)
    if type(out) is ModulesOut:
      out = _stacked_outputs(what, out, n, metadata_params, out_axes).rebuild(
          split_call((module,), {})[0])
    if "structure" in record:
      record["structure"].apply(
          split_call((module,), {})[0], variables, made, stacked_axis=0,
          partition_name=(metadata_params or {}).get("partition_name"),
          keep_metadata=True)
    return out

  compiled = compiled_when_eager(wrapper)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if not args and not any(map(is_node, jax.tree.leaves(kwargs, is_leaf=is_node))):
      # nnx's `init_vmap()`: nothing to map, `axis_size=` says how many to build
      return _vmap_creating(fn, (), kwargs, what=what, in_axes=in_axes, out_axes=out_axes,
                            axis_size=axis_size, axis_name=axis_name,
                            metadata_params=metadata_params)
    return compiled(*args, **kwargs)

  return call


def _refuse_mapping_plain(what, lifted, plan, variables, stacked) -> None:
  """Under the default ``variable_axes``, mapping a Variable that carries no layer axis
  would hand each example one row of a parameter: the per-example case
  (``sr.vmap(lambda m, x: m(x))(linear, xs)``) computes wrong numbers of the right
  shape. Only Variables of a stack (layer axis in their metadata) map by default."""
  for i in stacked:
    var = variables[i]
    if layer_axis(var) is not None:
      continue
    path = format_path(plan.display_path(lifted.graphdef.var_paths[i]))
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
        f"(`variable_axes={{{kind}: 0}}`).")


def _refuse_shared_write(what, lifted, variables, written) -> None:
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
      "depend on the mapped inputs.") from None


def _vmap_creating(fn, args, kwargs, *, what, in_axes, out_axes, axis_size, axis_name,
                   metadata_params):
  """``sr.vmap(f)(*args)`` where no argument holds a module, or ``sr.vmap(f,
  axis_size=n)()`` with no argument at all: ``jax.vmap(f)``, and the modules ``f``
  returns come out as stacks, as nnx's ``nnx.vmap(lambda key: Block(nnx.Rngs(key)))(
  keys)`` does: each Variable with the mapped axis where ``out_axes`` puts its module
  (default in front), marked as the layer axis there (and, with ``metadata_params=
  {"partition_name": ...}``, that name inserted into its ``sharding`` at that
  position), each returned module of the stacked class ``sr.vmap(Block, axis_size=n,
  in_axes=None)`` (mapping that axis)."""
  record: dict = {}

  def one(*call_args):
    with tracing_user_code(what):
      out = fn(*call_args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=is_node)
    placed = [(path, axis) for path, leaf, axis in _leaf_axes(out_axes, out, what)
              if is_node(leaf)]
    nodes = [leaf for leaf in leaves if is_node(leaf)]
    graphdef, variables = flatten(nodes)
    record["info"] = (graphdef, treedef, placed,
                      {i for i, leaf in enumerate(leaves) if is_node(leaf)})
    # The modules leave as their Variables' values (mapped axis in front, moved after);
    # the rest keeps its structure, modules left out, so out_axes fits it as jax's.
    rest = jax.tree.map(lambda x: None if is_node(x) else x, out, is_leaf=is_node)
    return [v.value for v in variables], rest

  ins = tuple(in_axes) if isinstance(in_axes, list) else in_axes
  try:
    values, rest = jax.vmap(one, in_axes=ins, out_axes=(0, out_axes),
                            axis_size=axis_size, axis_name=axis_name)(*args)
  except ValueError as e:
    if isinstance(e, TransformError) or not any(
        word in str(e) for word in ("axis size", "axis_size", "in_axes")):
      raise
    raise TransformError(
        f"{what}: {e} No argument holds a module, so this maps the function over its "
        "arguments as `jax.vmap` does (the modules it returns come out stacked). Fix "
        "in_axes, or pass `axis_size=` when nothing is mapped; to map a module's "
        "variables, argument 0 must be the module.") from None
  graphdef, treedef, placed, positions = record["info"]
  others = jax.tree.leaves(rest)
  if not positions:
    return jax.tree.unflatten(treedef, others)
  n = jnp.shape(values[0])[0] if values else axis_size
  multi = len(placed) > 1
  axes = [_placed_axis(what, placed[path[0]] if multi else placed[0],
                       path[1:] if multi else path, value)
          for path, value in zip(graphdef.var_paths, values)]
  root_axes: dict = {}
  for path, axis in zip(graphdef.var_paths, axes):
    root_axes.setdefault(path[0] if multi else 0, axis)
  values = [jnp.moveaxis(v, 0, axis) for v, axis in zip(values, axes)]
  name = (metadata_params or {}).get("partition_name")
  classes = {j: _stack_class(d[1], n, root_axes.get(j, 0)) for j, d in
             enumerate(graphdef.tree) if d[0] == _NODE and n is not None}
  graphdef = rewrite(graphdef, root_classes=classes,
                     metadata=lambda i, m: mark_frozen(m, axes[i], name))
  roots, _ = unflatten(graphdef, values)
  merged, nodes, rest = [], iter(roots), iter(others)
  for i in range(len(positions) + len(others)):
    merged.append(next(nodes) if i in positions else next(rest))
  return jax.tree.unflatten(treedef, merged)


def _leaf_axes(out_axes, out, what: str | None = None) -> list:
  """``(path, leaf, axis)`` for each leaf of ``out`` (modules and Variables as leaves),
  ``axis`` the entry of the ``out_axes`` prefix above it, as ``jax.vmap`` reads it.
  An ``out_axes`` that does not fit raises: a TransformError naming ``what`` if given,
  else the ValueError of ``jax.tree``."""
  found: list = []

  def add(path, axis, sub):
    for inner, leaf in jax.tree_util.tree_leaves_with_path(sub, is_leaf=is_node):
      found.append((path + inner, leaf, axis))

  try:
    jax.tree_util.tree_map_with_path(add, out_axes, out, is_leaf=lambda x: x is None)
  except ValueError as e:
    if what is None:
      raise
    raise TransformError(
        f"{what}: out_axes={out_axes!r} is not a prefix of the function's output "
        f"({jax.tree_util.tree_structure(out, is_leaf=is_node)}): {e} Fix: give one "
        "axis (e.g. `out_axes=0`), or a tuple / dict shaped like the output.") from None
  return found


def _placed_axis(what, placed, var_path, value) -> int:
  """Where the mapped axis of a Variable made inside goes: the ``out_axes`` entry of
  its module (``placed``: its output path and axis), as a non-negative axis of
  ``value`` (the Variable's value, mapped axis included)."""
  path, axis = placed
  where = f"the output `{jax.tree_util.keystr(path)}`" if path else "the output"
  ndim = jnp.ndim(value)
  if axis is None:
    raise TransformError(
        f"{what}: {where} is a module made inside the function, and out_axes gives it "
        "None (not mapped), but each index builds its own, so it comes out as a stack "
        "along the mapped axis. Fix: give it an axis (`out_axes=0` puts the layer axis "
        "in front).")
  if not isinstance(axis, int) or not -ndim <= axis < ndim:
    raise TransformError(
        f"{what}: out_axes puts the mapped axis of {where} at {axis!r}, but its "
        f"Variable `{format_path(var_path)}` has {ndim} axes with it (shape "
        f"{tuple(jnp.shape(value))}, mapped axis in front). Fix: give an axis in "
        f"{-ndim}..{ndim - 1}.")
  return axis % ndim


def _check_returned_inputs(what, out, out_axes, rebuilt, plan, values) -> None:
  """nnx's consistent aliasing between inputs and outputs: a module (or Variable) of
  the module argument that the function returns comes back as the caller's own
  object, laid out as ``variable_axes`` maps it, so an ``out_axes`` that puts a mapped
  Variable's axis elsewhere cannot be honoured: refused, not ignored. (``rebuilt``:
  the Variables inside, in the order of ``values``, the caller's values.)"""
  if not any(map(is_node, jax.tree.leaves(out, is_leaf=is_node))):
    return
  try:
    found = _leaf_axes(out_axes, out)
  except ValueError:
    return  # out_axes does not fit the output: jax.vmap says so
  index = {id(v): i for i, v in enumerate(rebuilt)}
  for path, leaf, axis in found:
    if not is_node(leaf):
      continue
    graphdef, variables = flatten([leaf])
    for var_path, var in zip(graphdef.var_paths, variables):
      i = index.get(id(var))
      if i is None or plan.kinds[i] != STACKED:
        continue
      ndim = jnp.ndim(values[i])
      mapped = plan.axes[i] % ndim
      if isinstance(axis, int) and -ndim <= axis < ndim and axis % ndim == mapped:
        continue
      at = jax.tree_util.keystr(path)
      full = at + ("." if at else "") + format_path(var_path) if var_path else at
      also = (f"map the Variable along axis {axis} on the way in too (`variable_axes="
              f"{{{filter_repr(type(var))}: {axis}}}`), " if isinstance(axis, int) and
              -ndim <= axis < ndim else "")
      raise TransformError(
          f"{what}: the function returns `{full or '<root>'}` "
          f"({type(var).__name__}, shape {tuple(jnp.shape(values[i]))}) of its module "
          f"argument, where out_axes puts the mapped axis at {axis!r}, but "
          f"variable_axes maps that Variable along axis {mapped}. A module passed in "
          "comes back as the caller's own object, laid out as variable_axes maps it, "
          "so out_axes cannot move its axis (nnx: inconsistent aliasing). Nothing was "
          f"changed. Fix: give {f'the output `{at}`' if at else 'that output'} "
          f"`out_axes={mapped}`, {also}or do not return the module (the caller holds "
          "it already).")


def _stacked_outputs(what, out: ModulesOut, n: int, metadata_params,
                     out_axes) -> ModulesOut:
  """``out`` with the Variables made inside marked as stacked (layer axis where the
  int ``out_axes`` put them) and each module made inside and returned of its stacked
  class; as it is for ``out_axes=None`` (nothing mapped: not a stack)."""
  if out_axes is None:
    return out
  graphdef, treedef, positions, n_roots, n_variables = out.info
  axes = [_placed_axis(what, ((), out_axes), path, value) for path, value in
          zip(graphdef.var_paths[n_variables:], out.values)]
  name = (metadata_params or {}).get("partition_name")
  classes = {j: _stack_class(d[1], n, axes[0] if axes else 0)
             for j, d in enumerate(graphdef.tree)
             if j >= n_roots and d[0] == _NODE}
  graphdef = rewrite(graphdef, root_classes=classes, metadata=lambda i, m: (
      mark_frozen(m, axes[i - n_variables], name) if i >= n_variables else m))
  return ModulesOut(out.leaves, out.values, (graphdef, treedef, positions, n_roots,
                                             n_variables))


def _vmapped_init(init: Callable, options: dict) -> Callable:
  """``@sr.vmap(in_axes=(None, 0))`` on ``__init__``: the constructor builds a stack.

  Each member is built by the undecorated ``__init__`` on a fresh instance, under
  ``sr.vmap`` of a function that returns it (so its Variables come out with the mapped
  axis in front); then ``self`` takes the stacked attributes. ``in_axes`` counts
  ``self`` as argument 0, as nnx's does, and ignores its entry. Arguments holding
  modules (an ``sr.Rngs`` of pre-split keys) are mapped by ``variable_axes``.
  """
  in_axes = options["in_axes"]

  @functools.wraps(init)
  def wrapper(self, *args, **kwargs):
    cls = type(self)
    axes = (list(in_axes[1:]) if isinstance(in_axes, (tuple, list)) else
            [in_axes] * len(args))
    holds = [any(map(is_node, jax.tree.leaves(a, is_leaf=is_node))) for a in args]
    nodes = {"args": {j: a for j, (a, h) in enumerate(zip(args, holds)) if h},
             "kwargs": {k: v for k, v in kwargs.items()
                        if any(map(is_node, jax.tree.leaves(v, is_leaf=is_node)))}}
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in nodes["kwargs"]}
    rest = [j for j, h in enumerate(holds) if not h]

    def build(*call):
      node_tree = call[0] if nodes["args"] or nodes["kwargs"] else {"args": {}, "kwargs": {}}
      plain = call[1:] if nodes["args"] or nodes["kwargs"] else call
      full = [None] * len(args)
      for j, a in node_tree["args"].items():
        full[j] = a
      for j, a in zip(rest, plain):
        full[j] = a
      member = object.__new__(cls)
      init(member, *full, **plain_kwargs, **node_tree["kwargs"])
      return member

    mapped_axes = tuple(axes[j] for j in rest) if len(axes) == len(args) else in_axes
    plain_args = [args[j] for j in rest]
    call_options = {**options, "in_axes": mapped_axes}
    if nodes["args"] or nodes["kwargs"]:
      stack = vmap(build, **call_options)(nodes, *plain_args)
    else:
      stack = vmap(build, **call_options)(*plain_args)
    for k, v in list(vars(stack).items()):
      if not k.startswith("_sr_"):
        _release(v, stack)
        setattr(self, k, v)

  return wrapper


def _release(value, owner) -> None:
  """Clears the owner link of the objects directly under ``owner`` (they move)."""
  if isinstance(value, Variable):
    if value._owner is not None and value._owner[0]() is owner:
      value._owner = None
  elif isinstance(value, Module):
    link = vars(value).get("_sr_owner")
    if link is not None and link[0]() is owner:
      vars(value)["_sr_owner"] = None
  elif isinstance(value, (list, tuple)):
    for v in value:
      _release(v, owner)
  elif isinstance(value, dict):
    for v in value.values():
      _release(v, owner)


_STACK_CLASSES: dict = {}


def _stack_class(cls: type, n: int, axis: int = 0) -> type:
  """The stacked class a module built under ``sr.vmap`` comes out as (one per layer
  class, size and layer axis): ``sr.vmap(cls, axis_size=n, in_axes=None)``, mapping
  ``axis`` (``variable_axes={True: axis}``) where out_axes put it elsewhere."""
  if "_sr_layer_class" in cls.__dict__:  # a stack made per member: stays as it is
    return cls
  key = (cls, n, axis)
  if key not in _STACK_CLASSES:
    rules = {} if axis == 0 else {"variable_axes": {True: axis}}
    _STACK_CLASSES[key] = vmap(cls, axis_size=n, in_axes=None, **rules)
  return _STACK_CLASSES[key]

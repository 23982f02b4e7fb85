"""flax.nnx's public names that are elsewhere here, spelled differently, or have no use:
the one table ``sr.<name>`` and ``sr.nn.<name>`` read when a name is missing.

The package's ``__getattr__`` raises an ``AttributeError`` with ``message``'s text and
``sr.nn``'s with ``message_in_nn``'s, so code ported from nnx (or linen) says where to
go. Every public name of ``flax.nnx`` 0.12 falls in one of four groups:

* the same name in ``sr`` (``sr.Module``, ``sr.Param``, ``sr.jit``, ``sr.state``, ...):
  nothing to do there; looked for in ``sr.nn`` (``nnx.Module`` sits beside
  ``nnx.Linear``), ``AT_TOP`` points up;
* a layer, activation or initializer, which lives in ``sr.nn`` (``nnx.Linear`` is
  ``sr.nn.Linear``): the package's ``__getattr__`` looks it up there, so the message
  never names a layer that is not there;
* another spelling or no equivalent: ``SPELLED_DIFFERENTLY``; linen's layer names that
  nnx renamed, ``LINEN``;
* nnx's type variables, submodules of its implementation and internal contexts
  (``A``, ``M``, ``graphlib``, ``pytreelib``, ``SplitContext``, ...), which ported
  model code does not name: Python's plain ``AttributeError``.

It sits in ``nn/``, the lowest floor both namespaces can read (``tests/test_layering.py``).
"""

from __future__ import annotations

# The package's names an nnx or linen user may look for in sr.nn (nnx keeps them beside
# its layers).
AT_TOP = frozenset(
  "Module Variable Param BatchStat Cache Intermediate Rngs RngStream State Optimizer jit grad "
  "value_and_grad remat scan vmap split merge state update graphdef clone pop iter_graph "
  "summary display eval_shape".split()
)

_SUMMARY = "use sr.summary(model, *inputs) (or sr.display(model) for the tree)"
_NO_ANNOTATION = (
  "statefulremat needs no data/static marking: a Module attribute holding Variables "
  "or Modules (also inside lists, tuples and dicts) is part of the graph, anything "
  "else is static configuration (hashable)"
)
_PLAIN_JAX = (
  "statefulremat has no wrapped {name}: apply jax.{jax_name} to the arrays, "
  "after `graphdef, state = sr.split(model)`, rebuilding the model inside "
  "with `sr.merge(graphdef, state)`"
)
_STATE = "sr.State (its leaves are the arrays; state.flat() gives the flat mapping)"

SPELLED_DIFFERENTLY: dict[str, str] = {
  # Containers and structure.
  "Dict": "use sr.ModuleDict, or simply assign a dict to a Module attribute",
  "List": "use sr.ModuleList, or simply assign a list to a Module attribute",
  "Object": "use sr.Module",
  "Pytree": f"use sr.Module ({_NO_ANNOTATION})",
  **dict.fromkeys(
    "data static Data Static dataclass is_data has_data register_data_type check_pytree".split(),
    _NO_ANNOTATION,
  ),
  "graph": (
    "use the top-level functions: sr.split, sr.merge, sr.update, sr.state, "
    "sr.graphdef, sr.clone, sr.pop, sr.iter_graph"
  ),
  "iter_modules": "use model.iter_modules() (a method of every sr.Module)",
  "iter_children": "use model.iter_modules() or sr.iter_graph(model)",
  "iter_module_children": "use model.iter_modules()",
  "recursive_map": "use sr.iter_graph(model) and change what it yields",
  "find_duplicates": "use sr.iter_graph(model): a shared node is yielded once",
  "view": "use model.set_attributes(**attributes) (or model.eval() / model.train())",
  "view_info": "use sr.summary(model) (it lists each module's attributes)",
  "with_attributes": "use model.set_attributes(**attributes) (on a sr.clone(model))",
  "flatten": "use sr.split(model) (a GraphDef and a State; state.flat() is flat)",
  "unflatten": "use sr.merge(graphdef, *states)",
  "to_tree": (
    "sr.Modules are JAX pytrees already: pass them to jax.jit / jax.tree.map "
    "as they are (or use sr.split)"
  ),
  "from_tree": "sr.Modules are JAX pytrees already (or use sr.merge)",
  "unpack": "use sr.split(model, *filters)",
  "split_context": "use sr.split (no context needed)",
  "merge_context": "use sr.merge (no context needed)",
  "update_context": "use sr.update (no context needed)",
  "current_update_context": "use sr.update (no context needed)",
  "set_graph_mode": "statefulremat has one graph mode: shared references always work",
  "set_graph_updates": "transforms always write mutations back to your modules",
  # State.
  "GraphState": f"use {_STATE}",
  "PureState": f"use {_STATE}",
  "NodeStates": f"use {_STATE}",
  "FlatState": "use state.flat() ({path tuple: array})",
  "to_flat_state": "use state.flat()",
  "from_flat_state": "use sr.State(nested dict) (or sr.split / sr.state)",
  "to_pure_dict": "use state.flat() (or jax.tree.map over the State: it is a pytree)",
  "replace_by_pure_dict": "use sr.update(model, state)",
  "restore_int_paths": "sr.State keeps list indices as ints already",
  "pure": f"not needed: {_STATE}",
  "as_pure": f"not needed: {_STATE}",
  "split_state": "use state.split(*filters)",
  "filter_state": "use state.filter(*filters)",
  "merge_state": "use sr.State.merge(*states)",
  "map_state": "use jax.tree.map(fn, state) (an sr.State is a pytree of arrays)",
  # Filters.
  "Everything": "use ... (or True) as the filter",
  "Nothing": "use None (or False) as the filter",
  "OfType": "use the Variable kind itself as the filter, e.g. sr.Param",
  "WithTag": ("use a callable filter: `lambda path, v: getattr(v, 'tag', None) == 'dropout'`"),
  # Variables and metadata.
  "VariableMetadata": "pass metadata as keywords: sr.Param(value, sharding=(...))",
  "with_metadata": (
    "pass metadata as keywords, sr.Param(value, sharding=(...)), or the "
    "layers' kernel_metadata= / bias_metadata="
  ),
  "with_partitioning": (
    "use the layers' kernel_metadata={'sharding': (...)} (or sr.Param(value, sharding=(...)))"
  ),
  "set_metadata": "use variable.set_metadata(**metadata)",
  "var_defaults": "pass metadata as keywords: sr.Param(value, sharding=(...))",
  "register_variable_name": ("subclass sr.Variable and set `collection = 'name'` on the class"),
  "variable_name_from_type": "use the kind's `collection` attribute: sr.Param.collection",
  "variable_type_from_name": (
    "use the Variable kind itself (sr.Param, sr.Intermediate, "
    "...); `sow` also takes a collection name"
  ),
  "vars_as": "not needed: sr.Variable kinds are plain classes",
  "with_vars": "not needed: sr.Variable kinds are plain classes",
  "Perturbation": (
    "statefulremat has no perturbations: sow the value with "
    "self.sow(sr.Intermediate, ...) and take gradients with sr.grad"
  ),
  "capture": ("call the model, then take what it sowed with sr.pop(model, sr.Intermediate)"),
  # RNGs.
  "split_rngs": (
    "use split_rngs= on the transform (sr.scan / sr.vmap / "
    "sr.remat_scan), e.g. split_rngs={'params': True}"
  ),
  "fork_rngs": "use rngs.fork(), or split_rngs= on the transform",
  "with_rngs": "use split_rngs= on the transform, or rngs.fork()",
  "reseed": "build a new sr.Rngs(seed) and pass it where the old one went",
  "restore_rngs": "not needed: sr transforms restore RNG state themselves",
  # Transforms.
  "StateAxes": ("use variable_axes={filter: axis} (and variable_broadcast=) on sr.scan / sr.vmap"),
  "Carry": "use variable_carry= on sr.scan / sr.remat_scan",
  "DiffState": "use wrt= on sr.grad / sr.value_and_grad (a filter)",
  "cond": _PLAIN_JAX.format(name="cond", jax_name="lax.cond"),
  "switch": _PLAIN_JAX.format(name="switch", jax_name="lax.switch"),
  "fori_loop": _PLAIN_JAX.format(name="fori_loop", jax_name="lax.fori_loop"),
  "while_loop": _PLAIN_JAX.format(name="while_loop", jax_name="lax.while_loop"),
  "custom_vjp": _PLAIN_JAX.format(name="custom_vjp", jax_name="custom_vjp"),
  "jvp": _PLAIN_JAX.format(name="jvp", jax_name="jvp"),
  "vjp": _PLAIN_JAX.format(name="vjp", jax_name="vjp"),
  "pmap": _PLAIN_JAX.format(name="pmap", jax_name="pmap") + ", or use sr.shard",
  "shard_map": _PLAIN_JAX.format(name="shard_map", jax_name="shard_map"),
  "checkify": _PLAIN_JAX.format(name="checkify", jax_name="experimental.checkify"),
  "make_jaxpr": _PLAIN_JAX.format(name="make_jaxpr", jax_name="make_jaxpr"),
  "map": _PLAIN_JAX.format(name="map", jax_name="lax.map") + ", or use sr.scan",
  "call": "call the module itself (or sr.merge(graphdef, state) and call that)",
  "cached_partial": "use sr.jit (it caches on the GraphDef itself)",
  "jit_partial": "use sr.jit (it caches on the GraphDef itself)",
  "transform_metadata": "use metadata_params= on sr.scan / sr.vmap",
  "PARTITION_NAME": ("use metadata_params={'partition_name': 'layers'} on sr.scan / sr.vmap"),
  # Sharding.
  "spmd": "use sr.shard, sr.get_partition_spec and sr.logical_to_mesh",
  "logical_axis_rules": "pass the rules to sr.shard(model, mesh, rules) / "
  "sr.logical_to_mesh(specs, rules)",
  "get_named_sharding": (
    "use sr.get_partition_spec(state) with jax.sharding.NamedSharding(mesh, spec)"
  ),
  "StateSharding": "use sr.get_partition_spec(state)",
  "use_eager_sharding": "use sr.shard(model, mesh, rules)",
  "using_eager_sharding": "use sr.shard(model, mesh, rules)",
  "get_abstract_model": "use sr.eval_shape(fn, *args)",
  "abstract_with_sharding": "use sr.eval_shape(fn, *args) and sr.get_partition_spec",
  "as_abstract": "use sr.eval_shape(fn, *args)",
  # Display, training, interop.
  "tabulate": _SUMMARY,
  "visualization": "use sr.display(model) (treescope) or sr.summary",
  "TrainState": "use sr.Optimizer(model, tx) (it holds the optax state)",
  "ModelAndOptimizer": "use sr.Optimizer(model, tx)",
  "training": "use sr.Optimizer(model, tx)",
  "optimizer": "use sr.Optimizer(model, tx)",
  "bridge": "use sr.interop (from_linen / to_linen / from_nnx / to_nnx)",
  "compat": "use sr.interop (from_linen / to_linen / from_nnx / to_nnx)",
  **dict.fromkeys(
    ("Metric", "MultiMetric", "metrics"),
    "statefulremat has no metrics: keep running sums in a plain Python loop",
  ),
  "EMA": "use optax.ema (or keep an sr.clone(model) and blend its State)",
  "Initializer": "use jax.nn.initializers.Initializer (the type of sr.nn.initializers)",
}

# flax.linen's layers that nnx renamed.
LINEN = {
  "Dense": "use sr.nn.Linear (flax.linen's Dense; parameters kernel and bias)",
  "DenseGeneral": "use sr.nn.LinearGeneral (flax.linen's DenseGeneral)",
}


def message(package: str, name: str, found_in_nn: bool) -> str | None:
  """The AttributeError's text for ``sr.<name>`` (``package``: the package's name), or
  None for Python's plain one; ``found_in_nn``: ``sr.nn`` has ``name``."""
  if found_in_nn:
    return (
      f"module {package!r} has no attribute {name!r}: layers, activations and "
      f"initializers live in sr.nn, use sr.nn.{name}"
    )
  if name in SPELLED_DIFFERENTLY:
    origin, hint = f"nnx.{name}", SPELLED_DIFFERENTLY[name]
  elif name in LINEN:
    origin, hint = f"flax.linen.{name}", LINEN[name]
  else:
    return None
  return f"module {package!r} has no attribute {name!r} ({origin}): {hint}"


def message_in_nn(package: str, name: str) -> str | None:
  """The AttributeError's text for ``sr.nn.<name>`` (``package``: ``sr.nn``'s name), or
  None for Python's plain one."""
  if name in AT_TOP:
    hint = f"use sr.{name} (it is at the top of the package)"
  else:
    hint = SPELLED_DIFFERENTLY.get(name) or LINEN.get(name)
  if hint is None:
    return None
  return f"module {package!r} has no attribute {name!r}: {hint}"

"""sr.remat: ``jax.checkpoint`` over functions and methods of modules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, Unpack, overload

import jax

from ..core._errors import GraphError
from ..core._filters import Filter, to_predicate
from ..core._kinds import RngState
from ..core._module import iter_graph
from ..core._rngs import Rngs, RngStream
from ._class_form import (
  M,
  P,
  R,
  Transform,
  cached_class_form,
  display_name,
  function_target,
  is_module_class,
  method_names,
  subclass,
)
from ._lift import check_no_nodes, commit, is_node, lift, serialised
from ._outputs import Restructured
from ._rules import Collections, Rules
from .memory._carries import report_remat
from .memory._policy_check import policy_check


class _Options(TypedDict, total=False):
  """The keywords of ``remat``, for its overloads (the implementation gives the defaults)."""

  policy: Callable[..., Any] | None
  prevent_cse: bool
  static_argnums: int | Sequence[int]
  variables: Filter
  rngs: Filter
  methods: Sequence[str] | None
  concrete: bool


@overload  # the class form: a subclass whose methods are rematted
def remat(target: type[M], **options: Unpack[_Options]) -> type[M]: ...
@overload  # the function form: the same signature
def remat(target: Callable[P, R], **options: Unpack[_Options]) -> Callable[P, R]: ...
@overload  # keywords only: a decorator of a class or a function
def remat(target: None = None, **options: Unpack[_Options]) -> Transform: ...
@cached_class_form
def remat(
  target: Callable | type | None = None,
  *,
  policy: Callable[..., Any] | None = None,
  prevent_cse: bool = True,
  static_argnums: int | Sequence[int] = (),
  variables: Filter = True,
  rngs: Filter = True,
  methods: Sequence[str] | None = None,
  concrete: bool = False,
):
  """Rematerialises ``target`` in the backward pass (``jax.checkpoint``), modules included.

  Args:
    target: a function whose arguments may contain modules (or a method), or a Module
      class (returns a subclass whose ``methods`` are rematted).
    policy: a ``jax.checkpoint_policies`` entry (``None`` saves nothing), checked
      against the body's ``checkpoint_name`` s when traced.
    prevent_cse: as in ``jax.checkpoint``; may be ``False`` under ``scan``.
    static_argnums: argument positions (the module or ``self`` is 0) of Python values
      the computation branches on.
    variables: a filter of the Variables traced into the checkpoint; the rest are
      closed over as constants.
    rngs: a stream filter of the RNG streams that may be drawn from inside (a name
      served by a ``default`` stream lifts that stream); drawing from another raises.
    methods: for a class target, the methods to remat (default ``["__call__"]``).
    concrete: removed from JAX; ``True`` raises an error pointing at ``static_argnums``.

  Returns:
    For a function, a function of the same signature that runs ``target`` under
    ``jax.checkpoint`` and writes its mutations back to the modules passed in; for a
    Module class, the subclass ``Remat{Name}``; with no ``target``, a decorator.

  Raises:
    TypeError: ``concrete=True``; a ``target`` that is not callable; ``methods`` with a
      function; a ``policy`` that is not one (a string, a factory not called); at call,
      ``static_argnums`` naming a position the call does not have.
    AttributeError: ``methods`` names a method the class does not define.
    sr.GraphError: at call, ``static_argnums`` marks an argument that holds a module; the function
      draws from an RNG stream ``rngs`` does not lift, or returns a module or a Variable.
    sr.TransformError: when traced, ``policy`` names values no ``checkpoint_name`` in
      the body gives (or saves what it should exclude).
    sr.TraceContextError: the call runs inside a plain JAX transform that closes over the
      module, so its new values would leak that transform's tracers.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(3, 3, rngs=sr.Rngs(0))
  >>> def loss(model, x):
  ...   return jnp.sum(sr.remat(lambda m, x: jnp.sin(m(x)))(model, x) ** 2)
  >>> g = sr.grad(loss)(model, jnp.ones((2, 3)))
  >>> g0 = sr.grad(lambda m, x: jnp.sum(jnp.sin(m(x)) ** 2))(model, jnp.ones((2, 3)))
  >>> bool(jnp.allclose(g["kernel"], g0["kernel"]))
  True
  >>> RematLinear = sr.remat(sr.nn.Linear)   # class form
  >>> RematLinear(3, 3, rngs=sr.Rngs(0))(jnp.ones((1, 3))).shape
  (1, 3)
  """
  if concrete:
    raise TypeError(
      "sr.remat(concrete=True) is gone: JAX removed `concrete` from jax.checkpoint. "
      "If the function branches on a Python value, mark that argument static: "
      "`sr.remat(f, static_argnums=(i,))` (argument 0 is the module or `self`)."
    )
  options: dict[str, Any] = dict(
    policy=policy,
    prevent_cse=prevent_cse,
    static_argnums=static_argnums,
    variables=variables,
    rngs=rngs,
  )
  if target is None:
    return functools.partial(remat, methods=methods, **options)
  if is_module_class(target):
    doc = f"{target.__name__} with {', '.join(method_names(methods))} under sr.remat."
    return subclass(target, "Remat", lambda m: remat(m, **options), methods, {}, doc)
  fn = function_target("sr.remat", target, takes="a function or a Module class", methods=methods)
  return _remat_function(fn, **options)


def _remat_function(
  fn: Callable, *, policy, prevent_cse, static_argnums, variables, rngs
) -> Callable:
  static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
  traced_pred = to_predicate(variables)
  what = f"sr.remat({display_name(fn)})"
  check = policy_check(policy, what)  # None for most policies: nothing to do per trace
  # The stream rules of scan's split_rngs, so a name served by a default stream counts
  # under the name asked for (`rngs="dropout"` lifts `sr.Rngs(0)`'s default stream).
  stream_rules = Rules(what, Collections(split_rngs=rngs))

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    # Normalised like jax.checkpoint's: negative positions count from the end.
    outside = [i for i in static if not -len(args) <= i < len(args)]
    if outside:
      raise TypeError(
        f"{what}: static_argnums={static_argnums!r} names position {outside[0]}, but "
        f"the call has {len(args)} positional argument(s) (the module or `self` is "
        "argument 0; keyword arguments are not counted). Fix static_argnums, or pass "
        "that value positionally."
      )
    statics = {i: args[i] for i in sorted({i % len(args) for i in static})}
    for i, arg in statics.items():
      if any(is_node(leaf) for leaf in jax.tree.leaves(arg, is_leaf=is_node)):
        raise GraphError(
          f"{what}: static_argnums={static_argnums!r} marks argument {i}, which holds "
          "a module. Modules are lifted into the checkpoint (their variables traced, "
          f"their mutations written back), never static: remove {i} from "
          "static_argnums and mark only the Python values the function branches on."
        )
    dynamic = tuple(a for i, a in enumerate(args) if i not in statics)
    lifted, variables_, leaves, nodes = lift(dynamic, kwargs)
    values = [v._value for v in variables_]
    lifted_streams = _lifted_streams(nodes, stream_rules)
    traced, frozen_rngs = [], set()
    for i, (path, var) in enumerate(zip(lifted.graphdef.var_paths, variables_)):
      if isinstance(var, RngState):
        split = lifted_streams.get(id(var))
        if split is None:
          split = stream_rules.splits(var._metadata.get("tag", "default"))
        if split:
          traced.append(i)
        else:
          frozen_rngs.add(i)
      elif traced_pred(path[1:] if len(nodes) > 1 else path, var):
        traced.append(i)  # filters see paths within their module, as in sr.state

    def call(*call_args, **call_kwargs):
      call_args = list(call_args)
      for i in sorted(statics):
        call_args.insert(i, statics[i])
      return fn(*call_args, **call_kwargs)

    def pure(traced_values, leaves):
      flat = list(values)
      for i, value in zip(traced, traced_values):
        flat[i] = value
      out, changes = lifted.run(call, flat, leaves, what, restructure=True)
      check_no_nodes(out, what)
      changed = changes.values
      if changes.structure is not None:  # attributes added or deleted: carried out after
        out = Restructured(out, changes.made, changes.structure)
      for i in changed:
        if i in frozen_rngs:
          var = variables_[i]
          raise GraphError(
            f"{what}: the function drew from the RNG stream {var.tag!r} "
            f"(`{var.path_str()}`), which is not lifted by `rngs={rngs!r}`. Fix: "
            f"include it, e.g. `sr.remat(..., rngs=True)` or `rngs=({var.tag!r}, ...)`."
          )
      return out, changed

    report_remat(policy)  # to an sr.scan step that offloads its carries, if inside one
    checkpointed = jax.checkpoint(pure, policy=policy, prevent_cse=prevent_cse)
    inputs = [values[i] for i in traced]
    if check is None:
      out, changed = checkpointed(inputs, leaves)
    else:
      out, changed = check.run(checkpointed, inputs, leaves)
    return commit(variables_, changed, what, out, nodes=nodes)

  return serialised(wrapper)  # threads on one model take turns; names deleted arrays


def _lifted_streams(nodes, rules: Rules) -> dict[int, bool]:
  """``{id(key or count Variable): lifted}`` of the RNG streams reachable from ``nodes``."""
  graph = [obj for node in nodes for _, obj in iter_graph(node)]
  out: dict[int, bool] = {}
  for obj in graph:
    if isinstance(obj, Rngs):
      own = obj.stream_names()
      for name in own:
        stream = vars(obj)[name]
        split = rules.splits_default(own) if name == "default" else rules.splits(name)
        out.setdefault(id(stream.key), split)
        out.setdefault(id(stream.count), split)
  for obj in graph:
    if isinstance(obj, RngStream):
      out.setdefault(id(obj.key), rules.splits(obj.tag))
      out.setdefault(id(obj.count), rules.splits(obj.tag))
  return out

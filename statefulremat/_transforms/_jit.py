"""sr.jit: ``jax.jit`` for functions whose arguments contain modules."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from ._lift import FlattenCache, check_no_nodes, split_call, write_back

_PASSED_THROUGH = {"keep_unused", "inline", "compiler_options", "backend", "device"}


def jit(fn: Callable | None = None, *, static_argnums: int | Sequence[int] = (),
        donate_state: bool = False, **jit_kwargs: Any) -> Callable:
  """Compiles ``fn`` with ``jax.jit``; modules in its arguments are updated in place.

  Every Variable the function changes (params, batch stats, RNG counts, optimizer
  state) is written back to the caller's objects after the call; if the call raises,
  nothing is written. Repeated calls on the same objects skip the graph walk: the
  flattening is cached until a module's structure changes.

  Args:
    fn: the function; modules may sit anywhere in its arguments.
    static_argnums: positions of hashable, non-array arguments to compile for.
    donate_state: donate the modules' current buffers to the computation (saves memory;
      every Variable is then written back, changed or not).
    **jit_kwargs: ``keep_unused``, ``inline``, ``compiler_options``, ``backend``, ``device``.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  >>> @sr.jit
  ... def shift(model, x):
  ...   model.bias.value = model.bias.value + 1
  ...   return model(x)
  >>> _ = shift(model, jnp.ones((1, 2)))
  >>> model.bias.value.tolist()
  [1.0, 1.0]
  """
  if fn is None:
    return functools.partial(jit, static_argnums=static_argnums,
                             donate_state=donate_state, **jit_kwargs)
  unknown = set(jit_kwargs) - _PASSED_THROUGH
  if unknown:
    raise TypeError(
        f"sr.jit does not take {sorted(unknown)}: shardings and donation of plain "
        "arguments refer to positions sr.jit rearranges. Use `donate_state=True` to "
        "donate module state, and place state with jax.device_put / sharding metadata."
    )
  static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
  cache = FlattenCache()
  what = f"sr.jit({getattr(fn, '__name__', 'fn')})"

  def pure(lifted, statics, values, leaves):
    tree, _, roots = lifted.rebuild(values, leaves)
    args, kwargs = tree
    args = _insert(args, statics)
    out = fn(*args, **kwargs)
    check_no_nodes(out, what)
    changed = lifted.collect(roots, values, what)
    if donate_state:
      changed = {i: changed.get(i, v) for i, v in enumerate(values)}
    return out, changed

  compiled = jax.jit(pure, static_argnums=(0, 1), donate_argnums=(2,) if donate_state
                     else (), **jit_kwargs)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    statics = ()
    if static:
      statics = tuple((i, args[i]) for i in static)
      args = tuple(a for i, a in enumerate(args) if i not in static)
    nodes, leaves, treedef, positions = split_call(args, kwargs)
    lifted, variables = cache.lift(nodes, treedef, positions)
    out, changed = compiled(lifted, statics, [v._value for v in variables], leaves)
    write_back(variables, changed)
    return out

  wrapper.lower = lambda *a, **k: _lower(compiled, cache, static, *a, **k)
  return wrapper


def _insert(args: tuple, statics: tuple) -> tuple:
  args = list(args)
  for i, value in statics:
    args.insert(i, value)
  return tuple(args)


def _lower(compiled, cache, static, *args, **kwargs):
  statics = tuple((i, args[i]) for i in static)
  args = tuple(a for i, a in enumerate(args) if i not in static)
  nodes, leaves, treedef, positions = split_call(args, kwargs)
  lifted, variables = cache.lift(nodes, treedef, positions)
  return compiled.lower(lifted, statics, [v._value for v in variables], leaves)

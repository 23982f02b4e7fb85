"""sr.jit: ``jax.jit`` for functions whose arguments contain modules."""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, overload

import jax
import jax.numpy as jnp

from ..core._graph_lock import hold, let_go
from ..core._module import Module
from ..core._variables import Variable
from ._lift import FlattenCache, commit, raise_if_deleted, split_call
from ._outputs import ModulesOut, Restructured

_PASSED_THROUGH = {"keep_unused", "inline", "compiler_options", "backend", "device"}

P = ParamSpec("P")
R = TypeVar("R", covariant=True)


class Jitted(Protocol[P, R]):
  """What ``sr.jit(fn)`` returns: ``fn``'s signature, and ``lower`` as on ``jax.jit``'s."""

  def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...
  def lower(self, *args: P.args, **kwargs: P.kwargs) -> jax.stages.Lowered: ...


@overload
def jit(
  fn: Callable[P, R],
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_state: bool = False,
  **jit_kwargs: Any,
) -> Jitted[P, R]: ...  # `@sr.jit`, `sr.jit(fn)`: the same signature
@overload
def jit(
  fn: None = None,
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_state: bool = False,
  **jit_kwargs: Any,
) -> Callable[[Callable[P, R]], Jitted[P, R]]: ...  # `@sr.jit(static_argnums=...)`
def jit(
  fn: Callable[..., Any] | None = None,
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_state: bool = False,
  **jit_kwargs: Any,
) -> Any:
  """Compiles ``fn`` with ``jax.jit``; modules in its arguments are updated in place.

  Args:
    fn: the function; modules may sit anywhere in its arguments. ``None`` (only
      keywords given) makes a decorator.
    static_argnums: positions of hashable, non-array arguments to compile for (default ``()``).
    static_argnames: names of hashable, non-array keyword arguments to compile for (default ``()``).
    donate_state: donate the modules' current buffers to the computation (every
      Variable is then written back, changed or not). Default ``False``.
    **jit_kwargs: ``keep_unused``, ``inline``, ``compiler_options``, ``backend``, ``device``.

  Returns:
    A function of ``fn``'s signature that runs it compiled, writes every change (values,
    added or deleted attributes; nothing if it raises) back to the modules passed in and
    returns ``fn``'s result (a module passed in as the caller's own object), with a
    ``lower(*args)`` method as on ``jax.jit``'s; with no ``fn``, a decorator.

  Raises:
    TypeError: a keyword in ``**jit_kwargs`` other than those five; at call,
      ``static_argnums`` naming a position the call does not have, or a static argument
      that is a module, a Variable, or not hashable.
    sr.TraceContextError: the call runs inside a plain JAX transform that closes over the
      module, so its new values would leak that transform's tracers.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  >>> @sr.jit
  ... def shift(model, x):
  ...   model.bias.value = model.bias.value + 1
  ...   return model(x)
  >>> _ = shift(model, jnp.ones((1, 2)))
  >>> model.bias.value.tolist()
  [1.0, 1.0]
  >>> made = sr.jit(lambda: sr.nn.Linear(2, 3, rngs=sr.Rngs(0)))()
  >>> made.kernel.value.shape
  (2, 3)
  >>> lowered = shift.lower(model, jnp.ones((1, 2)))
  >>> lowered.compile().memory_analysis().output_size_in_bytes >= 4 * 2 + 4 * 2
  True
  """
  if fn is None:
    return functools.partial(
      jit,
      static_argnums=static_argnums,
      static_argnames=static_argnames,
      donate_state=donate_state,
      **jit_kwargs,
    )
  unknown = set(jit_kwargs) - _PASSED_THROUGH
  if unknown:
    raise TypeError(
      f"sr.jit does not take {sorted(unknown)}; besides static_argnums, "
      f"static_argnames and donate_state it passes on {sorted(_PASSED_THROUGH)} to "
      "jax.jit. Shardings and donation of plain arguments refer to positions sr.jit "
      "rearranges: use `donate_state=True` to donate module state, and place state "
      "with jax.device_put / sharding metadata."
    )
  static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
  names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
  cache = FlattenCache()
  what = f"sr.jit({getattr(fn, '__name__', 'fn')})"

  def pure(lifted, statics, values, leaves):
    positional, named = statics

    def call(*args, **kwargs):
      merged = list(args)
      for i, value in positional:  # ascending, so each lands at its original position
        merged.insert(i, value)
      return fn(*merged, **kwargs, **dict(named))

    out, changes = lifted.run(call, values, leaves, what, restructure=True, outputs=True)
    changed = changes.values
    if changes.structure is not None:  # attributes added or deleted: carried out after
      out = Restructured(out, changes.made, changes.structure)
    if donate_state:
      changed = {i: changed.get(i, v) for i, v in enumerate(values)}
    return out, changed

  compiled = _per_structure(pure, dict(jit_kwargs, donate_argnums=(0,) if donate_state else ()))

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if static or names:
      statics, args, kwargs = _split_statics(static, names, args, kwargs, what)
    else:
      statics = ((), ())
    lifted, variables, leaves = cache.lift_call(args, kwargs)
    # `with held(variables)`, spelt out: the context manager's three calls cost about
    # 0.5 µs, 5 % of a small step's dispatch.
    lock = hold(variables)
    try:
      values = [v._value for v in variables]
      if donate_state:
        values = _unaliased(values, leaves)
      jitted, new = compiled(lifted, statics)
      out, changed = with_room(jitted, values, leaves) if new else jitted(values, leaves)
      nodes = split_call(args, kwargs)[0] if type(out) is Restructured else ()
      out = commit(variables, changed, what, out, nodes=nodes)
    except RuntimeError:
      raise_if_deleted(variables)
      raise
    finally:
      let_go(lock)
    if type(out) is ModulesOut:
      out = out.rebuild(split_call(args, kwargs)[0])
    return out

  def lower(*args, **kwargs):
    statics, args, kwargs = _split_statics(static, names, args, kwargs, what)
    lifted, variables, leaves = cache.lift_call(args, kwargs)
    return compiled(lifted, statics)[0].lower([v._value for v in variables], leaves)

  wrapper.lower = functools.partial(with_room, lower)  # pyright: ignore[reportAttributeAccessIssue]  # a function attribute, as on jax.jit's result
  return wrapper


def _per_structure(pure: Callable, options: dict) -> Callable:
  """``compiled(lifted, statics) -> (jitted, new)``: one LRU-bounded ``jax.jit`` per key."""
  cache: OrderedDict = OrderedDict()

  def compiled(lifted, statics) -> tuple[Callable, bool]:
    key = (lifted, statics)
    jitted = cache.get(key)
    if jitted is not None:
      cache.move_to_end(key)
      return jitted, False

    # The structure is bound in, not static (jax.jit would hash it on every call); and a
    # closure, not a partial, whose signature jax inspects slowly.
    def bound(values, leaves):
      return pure(lifted, statics, values, leaves)

    jitted = cache[key] = jax.jit(bound, **options)
    if len(cache) > 64:
      cache.popitem(last=False)
    return jitted, True

  return compiled


def _split_statics(
  static: tuple, names: tuple, args: tuple, kwargs: dict, what: str
) -> tuple[tuple, tuple, dict]:
  """Takes out the static arguments: ``((positional, named), other args, other kwargs)``."""
  n = len(args)
  indices = sorted({i + n if i < 0 else i for i in static})
  if indices and (indices[0] < 0 or indices[-1] >= n):
    raise TypeError(
      f"{what}: static_argnums={static} but only {n} positional arguments were given."
    )
  positional = tuple((i, args[i]) for i in indices)
  named = tuple((k, kwargs[k]) for k in names if k in kwargs)
  for where, value in positional + named:
    label = f"argument {where}" if isinstance(where, int) else f"argument {where!r}"
    if isinstance(value, (Module, Variable)):
      raise TypeError(
        f"{what}: {label} is a {type(value).__name__} and is marked static. sr.jit "
        "lifts modules and Variables itself; remove it from static_argnums/argnames."
      )
    try:
      hash(value)
    except TypeError:
      raise TypeError(
        f"{what}: static {label} ({type(value).__name__}) is not hashable. "
        "Static arguments key the compilation cache; pass a tuple or a frozen "
        "dataclass, or pass arrays as ordinary (non-static) arguments."
      ) from None
  args = tuple(a for i, a in enumerate(args) if i not in indices)
  kwargs = {k: v for k, v in kwargs.items() if k not in names}
  return (positional, named), args, kwargs


def _unaliased(values: list, leaves: list) -> list:
  """``values`` with a copy of each array XLA would not donate (twice, or also an argument)."""
  seen = {id(x) for x in jax.tree.leaves(leaves) if isinstance(x, jax.Array)}

  def fresh(x):
    if isinstance(x, jax.Array):
      if id(x) in seen:
        return jnp.copy(x)
      seen.add(id(x))
    return x

  return jax.tree.map(fresh, values)


# CPython 3.11-3.13 unmap a 16 KiB frame chunk as its last frame returns, so a deep trace pays
# per chunk boundary crossed; one above a frame reserving 512 KiB of value-stack slots (never
# initialised) crosses none (docs/guide/performance.md).
_ROOM_SLOTS = 1 << 16  # 8 bytes each: 512 KiB; the deepest trace measured used 40 KiB


def with_room(fn: Callable, *args, **kwargs):
  """``fn(*args, **kwargs)``, called where CPython's frame stack has 512 KiB free in one chunk.

  >>> with_room(max, 2, 3, key=abs)
  3
  """
  return fn(*args, **kwargs)


if sys.implementation.name == "cpython" and sys.version_info >= (3, 11):
  with_room.__code__ = with_room.__code__.replace(
    co_stacksize=with_room.__code__.co_stacksize + _ROOM_SLOTS
  )

"""The exceptions statefulremat raises, so users can catch them by kind.

Every message says what was wrong, where (a variable or attribute path such as
``layers[3].linear.kernel``) and how to fix it.
"""

from __future__ import annotations

import warnings


class StatefulRematError(Exception):
  """Base class of every error statefulremat raises on purpose; each is one of five kinds.

  ``TraceContextError``: a traced value crosses into a Variable of another trace.
  ``GraphError`` (a ``TypeError``): a module graph cannot be split, merged or changed as
  asked, or a module sits where a transform takes only arrays. ``StateMismatchError`` (a
  ``ValueError``): state does not fit a module (paths, shapes, dtypes; flax or state-dict
  variables in ``sr.interop``; a sharding or mesh that does not fit the arrays).
  ``TransformError`` (a ``ValueError``): a transform, the remat planner or the sharding
  rules were asked for something their arguments cannot give. ``CheckpointError``:
  saving or restoring failed (``CheckpointNotFoundError``, also a ``FileNotFoundError``,
  where there is no checkpoint at all).

  >>> import statefulremat as sr
  >>> try:
  ...   sr.remat_scan(lambda m, c: c, lengths=())
  ... except sr.StatefulRematError as e:
  ...   print(type(e).__name__, isinstance(e, ValueError))
  TransformError True
  """


class TraceContextError(StatefulRematError):
  """A traced value crossed into a Variable that belongs to another trace.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> w = sr.Param(jnp.zeros(2))
  >>> def leak(x):
  ...   w.value = x       # a plain jax.jit closing over a Variable
  ...   return x
  >>> try:
  ...   jax.jit(leak)(jnp.ones(2))
  ... except sr.TraceContextError:
  ...   print("refused; old value kept:", w.value.tolist())
  refused; old value kept: [0.0, 0.0]
  """


class GraphError(StatefulRematError, TypeError):
  """A module graph cannot be split, merged, or changed the way it was asked.

  Also raised where a transform finds a module (or Variable) in an argument that takes
  only arrays: modules go in argument 0.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> class Bad(sr.Module):
  ...   def __init__(self):
  ...     self.w = jnp.zeros(2)   # an array outside any Variable
  >>> try:
  ...   sr.split(Bad())
  ... except sr.GraphError as e:
  ...   print(str(e)[:40])
  attribute `w` holds an array (float32[2]
  """


class StateMismatchError(StatefulRematError, ValueError):
  """A State does not fit the module (or the other State) it is combined with.

  Also raised where flax or state-dict variables do not map onto a model
  (``sr.interop``; nothing is written) and where a ``sharding`` annotation or a mesh
  does not fit the arrays.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> model = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
  >>> try:
  ...   sr.update(model, sr.State({"weight": jnp.zeros((2, 2))}))
  ... except sr.StateMismatchError:
  ...   print("no variable at `weight`")
  no variable at `weight`
  """


class TransformError(StatefulRematError, ValueError):
  """A transform was asked for something that does not fit its arguments.

  Also raised by the remat planner (``sr.plan_remat``: a budget that is not an amount
  of memory, or that no plan fits) and by malformed sharding rules.

  >>> import statefulremat as sr
  >>> try:
  ...   sr.remat_scan(lambda m, c: c, lengths=())
  ... except sr.TransformError as e:
  ...   print(str(e)[:52])
  sr.remat_scan(<lambda>): lengths=() must be a non-em
  """


# Classes folded into the kinds above, by their old public names: importable, with a
# DeprecationWarning, for one release (the package's and sr.interop's module __getattr__
# resolve them here); not listed by dir() or __all__, not documented.
FOLDED = {
  "statefulremat.RematPlanError": TransformError,
  "statefulremat.ShardingError": StateMismatchError,
  "statefulremat.interop.InteropError": StateMismatchError,
}


def folded(name: str) -> type:
  """The kind that old public class ``name`` (``statefulremat.ShardingError``) became,
  with a DeprecationWarning that names it."""
  kind = FOLDED[name]
  old = "sr." + name.removeprefix("statefulremat.")
  warnings.warn(
    f"{old} is folded into sr.{kind.__name__} (statefulremat 0.1.0; the old name goes "
    f"in 0.2): catch sr.{kind.__name__} instead.",
    DeprecationWarning,
    stacklevel=3,  # folded <- the module's __getattr__ <- the code that named it
  )
  return kind


def refuse_hash(obj) -> None:
  """``__hash__`` of mutable graph objects (modules, Variables): always raises.

  A hash would let ``jax.jit(f, static_argnums=0)(model, x)`` cache on the object and
  serve its old output after the values change.
  """
  raise TypeError(
    f"unhashable type: {type(obj).__name__!r}. A module or Variable is mutable (its values change "
    "in place), so a hash of it would go stale: as a static argument of jax.jit "
    "(static_argnums / static_argnames), the compiled result would be served again "
    "after its values changed. Fix: pass it as an ordinary argument (modules and "
    "Variables are pytrees: `jax.jit(f)(model, x)`), or use `sr.jit`; to key a dict "
    "or set by it, use `id(obj)`."
  )


def format_path(path: tuple) -> str:
  """Formats a graph path as Python would reach it: ``('layers', 0, 'kernel')`` -> ``layers[0].kernel``."""
  out = []
  for key in path:
    if isinstance(key, str) and key.isidentifier():
      out.append(f".{key}" if out else key)
    else:
      out.append(f"[{key!r}]")
  return "".join(out) or "<root>"


def describe_mesh(mesh) -> str:
  """Names a JAX mesh in a message, each axis with its size and type:
  ``{'data': 2 Explicit, 'model': 4 Explicit}``."""
  axes = zip(mesh.shape.items(), mesh.axis_types)
  return "{" + ", ".join(f"{name!r}: {size} {kind.name}" for (name, size), kind in axes) + "}"

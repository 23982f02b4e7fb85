"""Variables: the mutable boxes that hold a module's arrays.

A module's state lives in Variables and only there. Each Variable kind names the
*collection* it belongs to (``Param`` -> ``"params"``, ``BatchStat`` ->
``"batch_stats"`` ...); transforms and filters treat variables by collection.
A Variable remembers the JAX trace it was created in: writing a traced value into a
Variable that belongs to another trace (a plain ``jax.jit`` closing over a module)
would leak the tracer, so it raises at the assignment instead.

Variables are also pytrees with one leaf, the value, so ``jnp.sum(w)``,
``jax.nn.relu(w)`` and ``jax.tree.map(f, w)`` work on them (JAX no longer converts
objects through ``__jax_array__`` at a jit boundary, and many ``jnp`` functions are
jitted). A Variable rebuilt from its leaf (``jax.tree.map``, or the argument of a plain
``jax.jit``) is a detached copy: it refuses traced values, so a mutation inside a plain
JAX transform raises instead of being dropped; use ``sr.jit`` & co. to mutate modules.

Everything a transform needs to know about the graph's *shape* changes only through
``Module.__setattr__`` and ``Variable.set_metadata``; both note it, so cached
flattenings (``sr.jit``'s fast path) know when to look again.
"""

from __future__ import annotations

import operator
import re
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Self, TypeVar

import jax
import numpy as np

from . import _display_hooks
from ._bookkeeping import OWNER
from ._caches import serials, structure_epoch
from ._errors import TraceContextError, format_path, refuse_hash
from ._tracing import contains_tracer as _contains_tracer
from ._tracing import current_trace
from ._tracing import guard as _guard


def _closure_read(var) -> None:
  if _contains_tracer(var._value):
    return  # a tracer of an enclosing trace: current, not a baked-in constant
  root = None
  for parent, _ in owner_chain(var):
    root = parent if parent is not None else root
  name = type(root).__name__ if root is not None else ""
  of = f" of {'an' if name[:1] in 'AEIOU' else 'a'} {name}" if name else ""
  raise TraceContextError(
    f"{_guard.what} read `{var.path_str()}` ({type(var).__name__}){of} that it was "
    "not given as an argument: a module reached by closure. Its value would be "
    "baked into the traced function as a constant and go stale when the module "
    "changes (e.g. after `opt.update`), and no write to it could come back. Fix: "
    "pass the module as an argument (`step(model, x)` instead of a function that "
    "closes over `model`)."
  )


def bare_variable(kind: type, value: Any, metadata: dict, trace) -> Variable:
  """Builds a Variable without running ``__init__`` (no checks, no owner)."""
  var = object.__new__(kind)
  _fill(var, value, metadata, trace)
  return var


def _fill(var, value: Any, metadata: dict, trace) -> None:
  """Sets every slot of ``var``, with no checks: a new Variable that no module holds."""
  var._value = value
  var._metadata = metadata
  var._trace = trace
  var._owner = None
  var._serial = next(serials)


A = TypeVar("A")  # what a Variable holds: an array, or any pytree


def _dtype_of(value):
  dtype = getattr(value, "dtype", None)
  return jax.numpy.result_type(value) if dtype is None else dtype


def _operators(op) -> tuple[Callable, Callable, Callable]:
  """A Variable's forward, reflected and in-place methods of binary operator ``op``."""

  def forward(self, other):
    return op(self.value, other.value if isinstance(other, Variable) else other)

  def backward(self, other):
    return op(other, self.value)

  def inplace(self, other):
    self.value = forward(self, other)
    return self

  return forward, backward, inplace


def _unary(op) -> Callable[[Any], Any]:
  return lambda self: op(self.value)


class Variable(Generic[A]):
  """A mutable box holding one array (or pytree) of a module's state.

  ``Variable(value, **metadata)``: ``metadata`` is free-form (``sharding=("embed",
  "mlp")`` is read by ``sr.get_partition_spec``) and readable as attributes.
  Subclass it to define a new kind; a direct subclass names its collection with a
  ``collection`` class attribute (default: the class name in snake case), deeper
  subclasses inherit their parent's. A Variable is generic in its value for type
  checkers: ``sr.Param(jnp.zeros(2))`` is a ``Param[jax.Array]``, whose ``.value`` (and
  ``get_value()``) is a ``jax.Array``.

  Args:
    value: the array (or pytree of arrays, or Python number) held.
    **metadata: free-form attributes kept beside the value (``sharding=``, ...), read
      as ``var.sharding``; none by default.

  Raises:
    TypeError: ``value`` is itself a Variable (pass ``other.value``).

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> w = sr.Param(jnp.ones((2, 3)), sharding=("embed", "mlp"))
  >>> w.shape, w.collection, w.sharding
  ((2, 3), 'params', ('embed', 'mlp'))
  >>> w.value = w.value * 2
  >>> float(w[0, 0] + 1)
  3.0
  >>> w += 1              # in place: `w` stays the same Param
  >>> float(w[0, 0])
  3.0
  >>> class Counter(sr.Variable): pass
  >>> Counter(0).collection
  'counter'
  """

  __slots__ = ("_value", "_metadata", "_trace", "_owner", "_serial", "__weakref__")
  collection: ClassVar[str] = "variables"
  _value: Any
  _owner: tuple[weakref.ref, tuple] | None  # (parent, key path): see set_owner

  # Arithmetic and comparisons act on `.value` (an array): `w * 2` is an array, and
  # `w += 1` updates the Variable in place (as flax.nnx does) instead of replacing the
  # module's attribute with a plain array.
  __add__, __radd__, __iadd__ = _operators(operator.add)
  __sub__, __rsub__, __isub__ = _operators(operator.sub)
  __mul__, __rmul__, __imul__ = _operators(operator.mul)
  __truediv__, __rtruediv__, __itruediv__ = _operators(operator.truediv)
  __floordiv__, __rfloordiv__, __ifloordiv__ = _operators(operator.floordiv)
  __mod__, __rmod__, __imod__ = _operators(operator.mod)
  __pow__, __rpow__, __ipow__ = _operators(operator.pow)
  __matmul__, __rmatmul__, __imatmul__ = _operators(operator.matmul)
  __and__, __rand__, __iand__ = _operators(operator.and_)
  __or__, __ror__, __ior__ = _operators(operator.or_)
  __xor__, __rxor__, __ixor__ = _operators(operator.xor)
  __lt__ = _operators(operator.lt)[0]
  __le__ = _operators(operator.le)[0]
  __gt__ = _operators(operator.gt)[0]
  __ge__ = _operators(operator.ge)[0]
  __neg__ = _unary(operator.neg)
  __pos__ = _unary(operator.pos)
  __abs__ = _unary(operator.abs)

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "collection" not in cls.__dict__ and Variable in cls.__bases__:
      cls.collection = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()  # snake case
    _register_pytree(cls)

  def __hash__(self):
    refuse_hash(self)  # mutable: see refuse_hash

  def __init__(self, value: A, **metadata: Any):
    if isinstance(value, Variable):
      raise TypeError(
        f"{type(self).__name__}(...) got a {type(value).__name__} as its value; a "
        "Variable holds arrays, not other Variables. Pass `other.value` instead."
      )
    _fill(self, None, metadata, current_trace())
    self.value = value

  # -- value -----------------------------------------------------------------

  @property
  def value(self) -> A:
    """The array held; assign to replace it."""
    if _guard.depth and self._serial < _guard.start:
      _closure_read(self)
    return self._value

  @value.setter
  def value(self, new: A):
    if isinstance(new, Variable):
      raise TypeError(
        f"cannot assign a {type(new).__name__} to `{self.path_str()}.value`; assign "
        "its array: `var.value = other.value`."
      )
    if _contains_tracer(new) and self._trace != current_trace():
      raise TraceContextError(
        f"a traced value was assigned to `{self.path_str()}` "
        f"({type(self).__name__}) from inside a JAX transform that does not own it "
        "(e.g. a plain `jax.jit`, `jax.grad` or `jax.vmap` whose function closes over "
        "the module, or gets the Variable as a plain argument). The tracer would leak "
        "out of its trace, so the old value is kept. Fix: pass the module as an "
        "argument to `sr.jit` / `sr.grad` / `sr.vmap` (or sr.scan/sr.remat) instead "
        "of closing over it."
      )
    self._value = new

  def get_value(self) -> A:
    """The array held: ``var.value``, as flax.nnx 0.12 spells it.

    Returns:
      The value (an array, or the pytree the Variable holds), read as ``.value`` reads
      it: inside ``sr.jit`` & co., a Variable the function reached by closure raises
      ``TraceContextError``.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> w = sr.Param(jnp.ones(2))
    >>> w.get_value().tolist()
    [1.0, 1.0]
    """
    return self.value

  def set_value(self, value: A) -> None:
    """Replaces the array held: ``var.value = value``, as flax.nnx 0.12 spells it.

    Args:
      value: the new array (or pytree).

    Raises:
      TypeError: ``value`` is a Variable (assign its ``.value``).
      TraceContextError: ``value`` is traced by a JAX transform that does not own the
        Variable (a plain ``jax.jit`` closing over the module), as for ``.value =``.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> w = sr.Param(jnp.ones(2))
    >>> w.set_value(w.get_value() * 3)
    >>> w.value.tolist()
    [3.0, 3.0]
    """
    self.value = value

  def path_str(self) -> str:
    """The variable's last known path from its root module, e.g. ``block.linear.kernel``.

    Recorded when it (or a module holding it) is assigned as a module attribute, the
    first owner winning; ``<root>`` for a variable no module holds.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> class Net(sr.Module):
    ...   def __init__(self):
    ...     self.layers = [sr.nn.Linear(2, 2, rngs=sr.Rngs(0))]
    >>> net = Net()
    >>> net.layers[0].kernel.path_str(), sr.Param(jnp.zeros(2)).path_str()
    ('layers[0].kernel', '<root>')
    """
    return format_path(path_of(self))

  # -- metadata --------------------------------------------------------------

  @property
  def metadata(self) -> dict[str, Any]:
    """A copy of the metadata; change it with ``set_metadata``."""
    return dict(self._metadata)

  def set_metadata(self, **metadata: Any) -> None:
    """Adds or replaces metadata entries (e.g. ``sharding=("embed", None)``).

    Other entries are kept. Metadata is part of the graph's structure, so ``sr.jit``
    traces again.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> w = sr.Param(jnp.ones((2, 3)), sharding=("embed", "mlp"), tied=False)
    >>> w.set_metadata(sharding=("embed", None))
    >>> w.metadata
    {'sharding': ('embed', None), 'tied': False}
    """
    self._metadata = {**self._metadata, **metadata}  # a new object: a walk's Stamp sees it
    structure_epoch.value += 1

  def __getattr__(self, name: str) -> Any:
    # Only reached when normal lookup fails: metadata entries read as attributes.
    try:
      return object.__getattribute__(self, "_metadata")[name]
    except (KeyError, AttributeError):
      raise AttributeError(
        f"{type(self).__name__} has no attribute or metadata entry {name!r}"
      ) from None

  def replace(self, value: A) -> Self:
    """A new Variable of the same kind and metadata holding ``value``.

    ``self`` is left as it is, and the new Variable belongs to no module yet.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> w = sr.Param(jnp.ones(2), sharding=("embed",))
    >>> w2 = w.replace(jnp.zeros(2))
    >>> type(w2).__name__, w2.sharding, w2.value.tolist(), w.value.tolist()
    ('Param', ('embed',), [0.0, 0.0], [1.0, 1.0])
    """
    return type(self)(value, **self._metadata)

  # -- array-like use --------------------------------------------------------

  def _read(self) -> Any:
    # `.value`, checks included, typed as what the methods below treat it as: an array.
    return self.value

  def __jax_array__(self):
    return self._read()

  def __array__(self, dtype=None, copy=None):
    return np.asarray(self._read(), dtype=dtype)

  # np.shape & co. also answer for Python scalars (a plain AttributeError here would
  # fall through to the metadata lookup and blame a missing metadata entry).
  shape = property(lambda self: np.shape(self._value), doc="The value's shape.")
  dtype = property(lambda self: _dtype_of(self._value), doc="The value's dtype.")
  ndim = property(lambda self: np.ndim(self._value), doc="The value's rank.")
  size = property(lambda self: np.size(self._value), doc="The value's element count.")

  def __getitem__(self, index):
    return self._read()[index]

  def __setitem__(self, index, new: Any):
    """``var[index] = x`` writes into the value (``var[...] = x`` replaces it whole).

    A new array is made (``.at[index].set``); the Variable keeps its identity.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> w = sr.Param(jnp.zeros((2, 2)))
    >>> w[0, 1] = 5.0
    >>> w[...] = w[...] + 1
    >>> w.value.tolist()
    [[1.0, 6.0], [1.0, 1.0]]
    """
    old = self._read()
    if isinstance(new, Variable):
      new = new.value
    if not (index is Ellipsis and jax.numpy.shape(new) == jax.numpy.shape(old)):
      new = jax.numpy.asarray(old).at[index].set(new)
    self.value = new

  __len__ = _unary(len)
  __iter__ = _unary(iter)
  __bool__ = _unary(bool)
  __float__ = _unary(float)
  __int__ = _unary(int)

  # -- pickling ----------------------------------------------------------------

  def __getstate__(self):
    # The trace and owner are per process and per graph: rebuilt, not saved.
    return {"value": self._value, "metadata": self._metadata}

  def __setstate__(self, state):
    _fill(self, state["value"], state["metadata"], current_trace())

  def __repr__(self) -> str:
    return _display_hooks.text(self)

  def __treescope_repr__(self, path, subtree_renderer):
    return _display_hooks.treescope(self, path, subtree_renderer)


# -- pytree registration ---------------------------------------------------------


_DETACHED = object()  # the trace of a Variable rebuilt from its pytree leaf: no real one


class _MetadataAux:
  """A Variable's metadata as pytree aux data: compared by value, hashed by its keys
  (values such as lists need not be hashable for ``jax.tree.map``)."""

  __slots__ = ("metadata",)

  def __init__(self, metadata: dict):
    self.metadata = metadata

  def __eq__(self, other):
    return isinstance(other, _MetadataAux) and self.metadata == other.metadata

  def __hash__(self):
    return hash(tuple(sorted(self.metadata)))

  def __repr__(self):
    return repr(self.metadata)


def _register_pytree(cls) -> None:
  def unflatten(aux, children):
    return bare_variable(cls, children[0], dict(aux.metadata), _DETACHED)

  jax.tree_util.register_pytree_with_keys(
    cls,
    lambda v: (((jax.tree_util.GetAttrKey("value"), v._value),), _MetadataAux(v._metadata)),
    unflatten,
    flatten_func=lambda v: ((v._value,), _MetadataAux(v._metadata)),
  )


_register_pytree(Variable)


# -- owners: where a variable or module sits, for error messages ---------------


def entries(container):
  """The ``(key, item)`` pairs of a list, tuple or dict (keys: indices or dict keys)."""
  return container.items() if isinstance(container, dict) else enumerate(container)


def set_owner(obj, parent, key_path: tuple) -> None:
  """Records that ``obj`` hangs off ``parent`` at ``key_path`` (first owner wins)."""
  if isinstance(obj, Variable):
    if obj._owner is None:
      obj._owner = (weakref.ref(parent), key_path)
  elif obj.__dict__.get(OWNER) is None:
    obj.__dict__[OWNER] = (weakref.ref(parent), key_path)


def release_owner(value, parent) -> None:
  """Forgets that the objects directly in ``value`` (a Variable, a module, or a list,
  tuple or dict of them) hang off ``parent``: they move to another owner."""
  if isinstance(value, Variable):
    if value._owner is not None and value._owner[0]() is parent:
      value._owner = None
  elif isinstance(value, (list, tuple, dict)):
    for _, v in entries(value):
      release_owner(v, parent)
  else:
    attrs = getattr(value, "__dict__", {})
    link = attrs.get(OWNER)
    if link is not None and link[0]() is parent:
      attrs[OWNER] = None


def owner_chain(obj):
  """Yields ``(parent, key_path)`` from ``obj`` up its recorded (first) owners; the
  chain ends at an object with no owner, at a parent that is gone (``None``) or where
  it comes back round a cycle."""
  seen = {id(obj)}
  while True:
    owner = obj._owner if isinstance(obj, Variable) else vars(obj).get(OWNER)
    if owner is None:
      return
    parent = owner[0]()
    yield parent, owner[1]
    if parent is None or id(parent) in seen:
      return
    seen.add(id(parent))
    obj = parent


def path_of(obj) -> tuple:
  """The last known path of a Variable or module from its root (best effort)."""
  path: tuple = ()
  for _, key_path in owner_chain(obj):
    path = key_path + path
  return path

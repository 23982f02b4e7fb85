"""Module: plain Python objects that own Variables, PyTorch style.

Write ``__init__`` eagerly (create the Variables and sub-modules there) and
``__call__`` to use them; there is no ``super().__init__()`` to call and no lazy
shape inference. A module's *graph* is everything reachable through its attributes:
sub-modules, Variables, and lists/tuples/dicts of them. Every other attribute is
static configuration and must be hashable (it becomes part of the GraphDef).

An attribute that holds a Variable keeps it: ``model.w += 1`` updates the Variable in
place, and assigning an array over it (``model.w = model.w * 2``) raises, pointing at
``model.w.value = ...``, since the array would silently leave the model's state.
Modules pickle (their Variables' values, not their traces or owner links); a stack,
whose class a class form made, pickles that class as the call that made it
(``transforms/_class_form``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import numpy as np

from . import _display_hooks
from ._bookkeeping import OWNER, is_bookkeeping
from ._caches import class_hooks
from ._containers import adopt
from ._errors import GraphError, format_path, refuse_hash
from ._tracing import structure_changed
from ._variables import Variable, entries, path_of, set_owner


def _is_array_like(value) -> bool:
  return isinstance(value, (jax.Array, np.ndarray, np.generic, numbers.Number))


def _refuse_array_over_variable(module, name: str, value) -> None:
  var = module.__dict__[name]
  path = format_path(path_of(module) + (name,))
  what = (
    f"a {value.dtype}{list(np.shape(value))} array"
    if hasattr(value, "dtype")
    else f"a Python {type(value).__name__}"
  )
  raise GraphError(
    f"`{path}` holds a {type(var).__name__}; assigning {what} over it would replace "
    "the Variable with a plain value that leaves the model's state (PyTorch refuses "
    "a tensor over a Parameter for the same reason). Fix: write the Variable's "
    f"value, `{path}.value = ...` (or `{path}[...] = ...`; `{path} += x` updates "
    "in place too). To replace the Variable itself, assign a Variable, or `del` it "
    "first."
  )


def _record_owners(parent, value, key_path: tuple) -> None:
  if isinstance(value, (Variable, Module)):
    set_owner(value, parent, key_path)
  elif isinstance(value, (list, tuple, dict)):
    for key, item in entries(value):
      _record_owners(parent, item, key_path + (key,))


def _append(values: tuple, value: Any) -> tuple:
  # Module.sow's default reduce_fn, as flax.nnx's: each sown value joins the tuple.
  return (*values, value)


def _kind_named(variable_type, module, name: str) -> type:
  """The Variable kind ``sow`` was given: a Variable subclass, or a collection name
  resolved to the most basic kind of that collection (``"intermediates"`` ->
  ``Intermediate``)."""
  if isinstance(variable_type, type) and issubclass(variable_type, Variable):
    return variable_type
  if isinstance(variable_type, str):
    for cls in _family(Variable):  # breadth first: a subclass of a match refines it
      if cls.collection == variable_type:
        return cls
    where = format_path(path_of(module) + (name,))
    raise GraphError(
      f"sow({variable_type!r}, {name!r}, ...) at `{where}`: no Variable kind has the "
      f"collection {variable_type!r}. Fix: pass the kind itself, e.g. "
      f"`self.sow(sr.Intermediate, {name!r}, value)`, or define one: `class "
      f"MyKind(sr.Variable): collection = {variable_type!r}`."
    )
  raise GraphError(
    f"sow takes a Variable kind (e.g. sr.Intermediate) or a collection name first, got "
    f"{variable_type!r}. Fix: `self.sow(sr.Intermediate, {name!r}, value)`."
  )


if TYPE_CHECKING:
  _Stack = TypeVar("_Stack")

  def _stack_layer(self: _Stack, index: int, /) -> _Stack:
    """``stack.layer(i)``: layer ``i`` of a stack, of the layer class (``core/_stacks``)."""
    ...

  def _stack_len(self) -> int:
    """``len(stack)``: the number of layers of a stack."""
    ...

  def _any_call(self, *args: Any, **kwargs: Any) -> Any:
    """A module's ``__call__``, where the type checker knows only that it is a Module."""
    ...


class Module:
  """Base class of stateful modules.

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> class Scale(sr.Module):
  ...   def __init__(self, n):
  ...     self.w = sr.Param(jnp.ones(n))
  ...     self.deterministic = False
  ...   def __call__(self, x):
  ...     return x * self.w
  >>> m = Scale(3)
  >>> m(jnp.arange(3.0)).tolist()
  [0.0, 1.0, 2.0]
  >>> m.eval().deterministic
  True
  >>> [(path, type(v).__name__) for path, v in m.iter_variables()]
  [(('w',), 'Param')]
  """

  if TYPE_CHECKING:
    # A stack, an instance of a class form (`sr.remat_scan(Block, ...)`), is typed as
    # its layer class (`Block`): typing has no intersection to add what the stack's
    # class adds, `stack.layer(i)` (a `Block`) and `len(stack)`, so every Module shows
    # them to the type checker (at run time only stacks have them). Assignments, not
    # `def`s: a subclass's own `self.layer = sr.nn.Linear(...)` then overrides them
    # without a type error.
    layer = _stack_layer
    __len__ = _stack_len
    # `sr.grad(lambda m: loss(m(x)))` types `m` as a Module (the bound of its argument
    # type), so a Module's call is known as taking anything; subclasses' own `__call__`
    # replace it.
    __call__ = _any_call

  def __init_subclass__(cls, **kwargs):
    # Every Module class is a pytree (raw jax.jit / jax.grad / jax.tree.map take
    # modules, see _pytree.py); JAX registers exact types, so each subclass once here.
    super().__init_subclass__(**kwargs)
    for hook in class_hooks:
      hook(cls)

  def __hash__(self):
    refuse_hash(self)  # mutable: see refuse_hash

  def __setattr__(self, name: str, value: Any) -> None:
    if isinstance(self.__dict__.get(name), Variable) and _is_array_like(value):
      _refuse_array_over_variable(self, name, value)
    value = adopt(value)
    if not is_bookkeeping(name):
      _record_owners(self, value, (name,))
    object.__setattr__(self, name, value)
    structure_changed(self)

  def __delattr__(self, name: str) -> None:
    object.__delattr__(self, name)
    structure_changed(self)

  # -- modes -----------------------------------------------------------------

  def set_attributes(self, **attributes: Any) -> Module:
    """Sets each given attribute on every module of the graph that already has it.

    >>> import statefulremat as sr
    >>> d = sr.nn.Dropout(0.5, rngs=sr.Rngs(0))
    >>> d.set_attributes(deterministic=True).deterministic
    True
    """
    for _, module in self.iter_modules():
      for name, value in attributes.items():
        if name in vars(module):
          setattr(module, name, value)
    return self

  def train(self, mode: bool = True) -> Module:
    """Training mode: sets ``deterministic=False`` and ``use_running_average=False`` on
    every module of the graph that has that attribute; returns ``self``.

    ``train(False)`` is ``eval()``, as in PyTorch.

    >>> import statefulremat as sr
    >>> bn = sr.nn.BatchNorm(3, use_running_average=True, rngs=sr.Rngs(0))
    >>> bn.train().use_running_average, bn.train(False).use_running_average
    (False, True)
    """
    if not isinstance(mode, bool):
      raise TypeError(f"train(mode) takes True or False (as PyTorch's), got {mode!r}.")
    if not mode:
      return self.eval()
    return self.set_attributes(deterministic=False, use_running_average=False)

  def eval(self) -> Module:
    """Evaluation mode: sets ``deterministic=True`` and ``use_running_average=True`` on
    every module of the graph that has that attribute; returns ``self``.

    >>> import statefulremat as sr
    >>> drop = sr.nn.Dropout(0.5, rngs=sr.Rngs(0))
    >>> drop.deterministic, drop.eval().deterministic
    (False, True)
    """
    return self.set_attributes(deterministic=True, use_running_average=True)

  # -- intermediates -----------------------------------------------------------

  def sow(
    self,
    variable_type: type[Variable] | str,
    name: str,
    value: Any,
    reduce_fn: Callable[[Any, Any], Any] | None = None,
    init_fn: Callable[[], Any] = tuple,
  ) -> bool:
    """Keeps ``value`` in the Variable ``self.<name>`` of kind ``variable_type``, as
    flax.nnx's ``Module.sow``: by default appended to a tuple, so a module called
    twice keeps both values. Returns True.

    The first sow creates the Variable (``variable_type(reduce_fn(init_fn(), value))``);
    later ones replace its value with ``reduce_fn(old, value)``; ``reduce_fn=None`` (the
    default) appends, ``(*old, value)``. ``variable_type`` is a
    Variable kind (usually ``sr.Intermediate``) or its collection name
    (``"intermediates"``). Take the values out with ``sr.pop(model, sr.Intermediate)``,
    which also removes the Variables, so the next call starts afresh.

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> class Net(sr.Module):
    ...   def __init__(self):
    ...     self.linear = sr.nn.Linear(2, 3, rngs=sr.Rngs(0))
    ...   def __call__(self, x):
    ...     h = self.linear(x)
    ...     self.sow(sr.Intermediate, "features", h)
    ...     self.sow(sr.Intermediate, "total", h.sum(), init_fn=lambda: 0.0,
    ...              reduce_fn=lambda old, new: old + new)
    ...     return h
    >>> net = Net()
    >>> _ = net(jnp.ones((1, 2))); _ = net(jnp.ones((1, 2)))
    >>> [h.shape for h in net.features.value]
    [(1, 3), (1, 3)]
    >>> sorted(sr.pop(net, sr.Intermediate).flat()), hasattr(net, "features")
    ([('features',), ('total',)], False)
    """
    kind = _kind_named(variable_type, self, name)
    if reduce_fn is None:
      reduce_fn = _append
    if name not in vars(self):
      if hasattr(type(self), name):
        raise GraphError(
          f"sow: `{format_path(path_of(self) + (name,))}` names a "
          f"{type(getattr(type(self), name)).__name__} of the class "
          f"{type(self).__name__}; a sown value needs a name of its own. Fix: sow under "
          "another name."
        )
      setattr(self, name, kind(reduce_fn(init_fn(), value)))
      return True
    old = vars(self)[name]
    if type(old) is not kind:
      path = format_path(path_of(self) + (name,))
      if isinstance(old, Variable):
        what = f"a {type(old).__name__}"
        fix = (
          f"sow under another name, or with the kind it holds: "
          f"`self.sow({type(old).__name__}, {name!r}, value)`"
        )
      else:
        what, fix = f"a plain {type(old).__name__} attribute", "sow under another name"
      raise GraphError(
        f"sow({kind.__name__}, {name!r}, ...): `{path}` is {what}, not of kind "
        f"{kind.__name__}, so the value cannot be added to it (nothing was changed). "
        f"Fix: {fix}."
      )
    old.value = reduce_fn(old.value, value)
    return True

  # -- iteration -------------------------------------------------------------

  def iter_modules(self) -> Iterator[tuple[tuple, Module]]:
    """Yields ``(path, module)`` for every module of the graph once, this one first.

    Depth first, attributes in name order; a module reached twice is yielded at its
    first path only.

    >>> import statefulremat as sr
    >>> class Net(sr.Module):
    ...   def __init__(self):
    ...     self.layers = [sr.nn.Linear(2, 2, rngs=sr.Rngs(i)) for i in range(2)]
    >>> [(path, type(m).__name__) for path, m in Net().iter_modules()]
    [((), 'Net'), (('layers', 0), 'Linear'), (('layers', 1), 'Linear')]
    """
    return ((path, node) for path, node in iter_graph(self) if isinstance(node, Module))

  def iter_variables(self) -> Iterator[tuple[tuple, Variable]]:
    """Yields ``(path, variable)`` for every Variable of the graph once.

    Same order as ``iter_modules``; a shared Variable comes at its first path only.

    >>> import statefulremat as sr
    >>> class Tied(sr.Module):
    ...   def __init__(self):
    ...     self.a = sr.nn.Linear(2, 2, rngs=sr.Rngs(0))
    ...     self.b = sr.nn.Linear(2, 2, rngs=sr.Rngs(1))
    ...     self.b.kernel = self.a.kernel
    >>> [path for path, _ in Tied().iter_variables()]
    [('a', 'bias'), ('a', 'kernel'), ('b', 'bias')]
    """
    return ((path, node) for path, node in iter_graph(self) if isinstance(node, Variable))

  # -- pickling ----------------------------------------------------------------

  def __getstate__(self):
    # Owner links are weak references: rebuilt on load, never saved.
    return {k: v for k, v in vars(self).items() if k != OWNER}

  def __setstate__(self, state):
    self.__dict__.update(state)
    for name, value in state.items():
      if not is_bookkeeping(name):
        _record_owners(self, value, (name,))

  def __repr__(self) -> str:
    return _display_hooks.text(self)

  def __treescope_repr__(self, path, subtree_renderer):
    return _display_hooks.treescope(self, path, subtree_renderer)


def on_new_class(hook) -> None:
  """Calls ``hook(cls)`` for every Module class: those defined already, and each new
  one as it is defined."""
  class_hooks.append(hook)
  for cls in _family(Module):
    hook(cls)


def _family(root: type) -> Iterator[type]:
  """``root`` and every subclass of it, breadth first."""
  todo = [root]
  for cls in todo:  # the list grows as the loop goes
    yield cls
    todo.extend(cls.__subclasses__())


def iter_graph(node) -> Iterator[tuple[tuple, Any]]:
  """Yields ``(path, object)`` for each module and Variable reachable from ``node``,
  once, in the GraphDef's order (a module's attributes sorted), each before what it
  holds. (The public ``sr.iter_graph``, in ``_iter_graph``, follows flax.nnx instead:
  children first, containers and static attributes included.)"""
  for path, obj, first in arrivals(node, sort=True):
    if first:
      yield path, obj


def arrivals(root, *, sort: bool = False) -> Iterator[tuple[tuple, Any, bool]]:
  """Yields ``(path, object, first)`` each time the walk reaches a module or Variable,
  a module's attributes in definition order (as drawn and tabled) or, with ``sort``,
  sorted (the GraphDef's order); a module reached again is not entered again."""
  seen: set[int] = set()

  def walk(obj, path):
    if isinstance(obj, (Variable, Module)):
      first = id(obj) not in seen
      seen.add(id(obj))
      yield path, obj, first
      if first and isinstance(obj, Module):
        attrs = vars(obj)
        for k in sorted(attrs) if sort else attrs:
          if not is_bookkeeping(k):
            yield from walk(attrs[k], path + (k,))
    elif isinstance(obj, (list, tuple, dict)):
      for k, x in entries(obj):
        yield from walk(x, path + (k,))

  yield from walk(root, ())

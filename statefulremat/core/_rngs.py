"""Rngs: named PRNG streams whose counters live in the module graph's State.

Each stream holds a base key (``RngKey``) and a counter (``RngCount``). Drawing
folds the counter into the key and advances it, so every draw is fresh, across calls
and through transforms (the counter is state that transforms carry out like any other
variable). ``Rngs(0)`` makes a ``default`` stream that serves any name asked for;
``Rngs(params=0, dropout=1)`` makes named streams; both may be combined.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp

from ._bookkeeping import LAYER_KEYS
from ._kinds import RngCount, RngKey
from ._module import Module


def _as_key(seed) -> jax.Array:
  if isinstance(seed, int):
    return jax.random.key(seed)
  try:
    array = jnp.asarray(seed)
  except (TypeError, ValueError):
    got = repr(seed)
  else:
    if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
      return array
    if array.dtype == jnp.uint32 and array.shape[-1:] == (2,):
      return jax.random.wrap_key_data(array)
    if array.ndim == 0 and jnp.issubdtype(array.dtype, jnp.integer):
      return jax.random.key(array)
    got = f"{array.dtype}{list(array.shape)}"
  raise TypeError(
    f"an RNG seed must be an int, a typed key (jax.random.key) or a raw uint32 key, got {got}."
  )


def _refuse_split_keys(shape: tuple, tag: str) -> None:
  """Drawing from a stream that holds one key per layer, outside a vmap mapping it."""
  n = shape[0]
  one = "sr.Rngs(key)" if tag == "default" else f"sr.Rngs({tag}=key)"
  raise ValueError(
    f"sr.Rngs: the stream {tag!r} holds a key array of shape {tuple(shape)} ({n} keys, "
    "as `jax.random.split(key, n)` makes): one key per layer, so it can only be drawn "
    "from inside an sr.vmap that maps it (each layer then draws from its own key), "
    "as in nnx's `nnx.vmap(create, in_axes=0)(nnx.Rngs(jax.random.split(key, n)))`. "
    "Fix: pass the Rngs through sr.vmap (`sr.vmap(lambda rngs: Block(rngs=rngs))"
    f"(rngs)` builds {n} layers), or draw from one key, `{one}` (the class forms, "
    f"`sr.vmap(Block, axis_size={n})(..., rngs={one})`, split it themselves)."
  )


class RngStream(Module):
  """One named stream: ``stream()`` returns a fresh key and advances the counter.

  Args:
    seed: an int, a typed key (``jax.random.key``) or a raw uint32 key; or one key per
      layer (``jax.random.split(key, n)``), drawn from inside an ``sr.vmap`` mapping it.
    tag: the stream's name (``"params"``, ``"dropout"``, ``"default"``), kept on its
      key and count.

  Raises:
    TypeError: ``seed`` is not an int or a key.
    ValueError: ``seed`` holds keys of more than one axis.

  >>> import jax, statefulremat as sr
  >>> stream = sr.RngStream(0, tag="dropout")
  >>> k1, k2 = stream(), stream()
  >>> bool((jax.random.key_data(k1) != jax.random.key_data(k2)).any()), int(stream.count.value)
  (True, 2)
  """

  def __init__(self, seed, *, tag: str):
    key = _as_key(seed)
    if key.ndim > 1:
      raise ValueError(
        f"sr.Rngs: the stream {tag!r} got keys of shape {tuple(key.shape)}; it takes "
        "one key, or one key per layer (`jax.random.split(key, n)`, shape (n,))."
      )
    # Pre-split keys (shape (n,)): one stream per layer, a stack's state (layer axis
    # 0), drawn from inside an sr.vmap that maps it.
    meta = {"layer_axis": ((0, None),)} if key.shape else {}
    self.key = RngKey(key, tag=tag, **meta)
    self.count = RngCount(jnp.zeros(key.shape, jnp.uint32), tag=tag, **meta)
    self.tag = tag

  def __call__(self) -> jax.Array:
    count = self.count.value
    if jnp.ndim(count):  # one count per pre-split key
      _refuse_split_keys(jnp.shape(count), self.tag)
    self.count.value = count + 1
    return jax.random.fold_in(self.key.value, count)


class LayerKeys:
  """One iteration's keys for the names a ``default`` stream serves, inside a transform.

  A transform that splits RNG streams per iteration (scan, vmap, a stacked init) puts
  this on its per-iteration copy of an ``Rngs``, so the split rule holds for the name
  asked even when one default stream serves several names (``split_rngs={"params":
  True, "dropout": False}`` with ``sr.Rngs(0)``). ``base`` is the stream's key for this
  call, ``index`` the iteration, ``splits(name)`` the rule; ``asked`` collects the
  names drawn, so the transform can check the names its ``split_rngs`` typed.
  """

  __slots__ = ("base", "index", "splits", "asked")

  def __init__(self, base, index, splits, asked: set | None = None):
    self.base, self.index, self.splits = base, index, splits
    self.asked = set() if asked is None else asked

  def __reduce__(self):
    # Pickled as a plain tuple, naming no private class; Rngs.__setstate__ makes it
    # a LayerKeys again.
    return tuple, ((self.base, self.index, self.splits, self.asked),)


class _ServedStream:
  """The default stream as drawn for one name whose split rule differs from its own."""

  __slots__ = ("stream", "name", "layer")

  def __init__(self, stream: RngStream, name: str, layer: LayerKeys):
    self.stream, self.name, self.layer = stream, name, layer

  def __call__(self) -> jax.Array:
    count = self.stream.count.value
    self.stream.count.value = count + 1
    key = self.layer.base
    if self.layer.splits(self.name):
      key = jax.random.fold_in(key, self.layer.index)
    return jax.random.fold_in(key, count)

  def __getattr__(self, name):
    return getattr(self.stream, name)


class Rngs(Module):
  """Named PRNG streams: ``rngs.params()``, ``rngs["dropout"]()``.

  ``Rngs(0)`` serves every name from one ``default`` stream;
  ``Rngs(params=0, dropout=1)`` gives each name its own stream;
  ``Rngs(0, dropout=1)`` has a ``dropout`` stream and a default for the rest.
  Stored on a module, an Rngs is part of the module's graph (collection ``"rngs"``).

  Args:
    default: the seed of the ``default`` stream, which serves every name without a
      stream of its own (an int, a typed ``jax.random.key`` or a raw uint32 key; or
      ``jax.random.split(key, n)``, one key per layer, for ``sr.vmap``). None (the
      default): no default stream, so only the names in ``streams`` can be drawn.
    **streams: a seed (as ``default`` takes it) for each stream of its own, by name.

  Raises:
    ValueError: no seed at all, two default seeds (positional and ``default=``), or a
      stream name that starts with ``_`` or is an Rngs method.
    TypeError: a seed is not an int or a key.

  >>> import statefulremat as sr
  >>> rngs = sr.Rngs(0, dropout=1)
  >>> rngs.params().shape, sorted(rngs.stream_names())
  ((), ['default', 'dropout'])
  """

  def __init__(self, default: Any = None, /, **streams: Any):
    for name in streams:
      if name.startswith("_"):
        raise ValueError(
          f"{name!r} cannot name an RNG stream: names starting with '_' are reserved."
        )
      # Every Rngs attribute (fork, stream_names, and Module's train, eval, ...):
      # a stream of that name would shadow the method.
      if hasattr(Rngs, name):
        raise ValueError(
          f"{name!r} cannot name an RNG stream: it is an Rngs method "
          f"(`rngs.{name}`). Choose another name."
        )
    if default is not None:
      if "default" in streams:
        raise ValueError(
          "Rngs got two default seeds: a positional one and `default=`. Pass one: "
          "sr.Rngs(0) or sr.Rngs(default=0)."
        )
      streams = {"default": default, **streams}
    if not streams:
      raise ValueError("Rngs needs a seed: sr.Rngs(0) or sr.Rngs(params=0, dropout=1).")
    for name, seed in streams.items():
      setattr(self, name, RngStream(seed, tag=name))

  def stream_names(self) -> list[str]:
    """The names of the streams this Rngs holds (``default`` included).

    Names served by ``default`` are not streams of their own and are not listed.

    >>> import statefulremat as sr
    >>> rngs = sr.Rngs(0, dropout=1)
    >>> _ = rngs.params()
    >>> rngs.stream_names(), "params" in rngs
    (['default', 'dropout'], False)
    """
    return [k for k, v in vars(self).items() if isinstance(v, RngStream)]

  def default_stream(self, name: str) -> RngStream:
    """The stream that serves ``name``: its own, else ``default``; raises if neither.

    ``rngs.name`` and ``rngs["name"]`` go through it.

    >>> import statefulremat as sr
    >>> rngs = sr.Rngs(0, dropout=1)
    >>> rngs.default_stream("dropout").tag, rngs.default_stream("params").tag
    ('dropout', 'default')
    >>> sr.Rngs(dropout=1).default_stream("params")
    Traceback (most recent call last):
    AttributeError: this Rngs has no 'params' stream and no default stream ...
    """
    stream = vars(self).get(name)
    if stream is None:
      stream = vars(self).get("default")
      layer = vars(self).get(LAYER_KEYS)
      if layer is not None and stream is not None:
        layer.asked.add(name)
        if layer.splits(name) != layer.splits("default"):
          # A proxy with the stream's interface (calls draw keys, attributes forward).
          return cast(RngStream, _ServedStream(stream, name, layer))
    if stream is None:
      raise AttributeError(
        f"this Rngs has no {name!r} stream and no default stream (it has "
        f"{self.stream_names()}). Fix: add one, e.g. sr.Rngs({name}=0, ...), or give "
        "a default seed: sr.Rngs(0)."
      )
    return stream

  def __setstate__(self, state):
    if isinstance(state.get(LAYER_KEYS), tuple):
      state = {**state, LAYER_KEYS: LayerKeys(*state[LAYER_KEYS])}
    super().__setstate__(state)

  def __getattr__(self, name: str) -> RngStream:
    # Only reached for names that are not attributes: serve them from `default`.
    # Never for private names: tools probe `_repr_html_`, `_ipython_display_` & co.,
    # and serving those would hand out (and count) keys.
    if name.startswith("_"):
      raise AttributeError(name)
    return self.default_stream(name)

  def __call__(self) -> jax.Array:
    """A fresh key from the ``default`` stream, as flax.nnx's ``rngs()``: the same as
    ``rngs.default()``.

    >>> import jax, statefulremat as sr
    >>> rngs = sr.Rngs(0)
    >>> k1, k2 = rngs(), rngs()
    >>> bool((jax.random.key_data(k1) != jax.random.key_data(k2)).any())
    True
    >>> int(rngs.default.count.value)
    2
    """
    stream = vars(self).get("default")
    if not isinstance(stream, RngStream):
      names = self.stream_names()
      raise AttributeError(
        f"rngs() draws from the default stream, but this Rngs has none (it has "
        f"{names}). Fix: draw from a named stream, e.g. `rngs.{names[0]}()`, or give "
        f"a default seed: `sr.Rngs(0, {names[0]}=...)`."
      )
    return stream()

  def __getitem__(self, name: str) -> RngStream:
    return self.default_stream(name)

  def __contains__(self, name: str) -> bool:
    return isinstance(vars(self).get(name), RngStream)

  def fork(self) -> Rngs:
    """A new, independent Rngs with the same stream names, seeded from this one.

    Each new stream's seed is one key drawn from the stream of the same name here, so
    forking advances this Rngs's counters once; drawing from the fork does not.

    >>> import jax, statefulremat as sr
    >>> rngs = sr.Rngs(0, dropout=1)
    >>> child = rngs.fork()
    >>> child.stream_names(), int(rngs.dropout.count.value)
    (['default', 'dropout'], 1)
    >>> k1, k2 = child.dropout(), rngs.dropout()
    >>> bool((jax.random.key_data(k1) != jax.random.key_data(k2)).any())
    True
    >>> int(child.dropout.count.value), int(rngs.dropout.count.value)
    (1, 2)
    """
    new = object.__new__(Rngs)
    for name in self.stream_names():
      setattr(new, name, RngStream(getattr(self, name)(), tag=name))
    return new

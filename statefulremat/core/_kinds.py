"""The Variable kinds statefulremat ships, one per collection.

``Param`` (``"params"``), ``BatchStat`` (``"batch_stats"``), ``Cache`` (``"cache"``),
``Intermediate`` (``"intermediates"``) and the RNG state kinds (``"rngs"``). A user
kind subclasses ``sr.Variable`` (a new collection) or one of these (the same one).
"""

from __future__ import annotations

from ._variables import A, Variable


class Param(Variable[A]):
  """A trainable parameter (collection ``"params"``).

  Args:
    value: the parameter's array (or pytree of arrays).
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.Param(jnp.zeros(3)).collection
  'params'
  """

  collection = "params"


class BatchStat(Variable[A]):
  """A running statistic updated in training mode (collection ``"batch_stats"``).

  Args:
    value: the statistic's array (a running mean or variance, ...).
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.BatchStat(jnp.zeros(3)).collection
  'batch_stats'
  """

  collection = "batch_stats"


class Cache(Variable[A]):
  """A decoding cache or similar scratch state (collection ``"cache"``).

  Args:
    value: the cached array (or pytree of arrays).
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.Cache(jnp.zeros(3)).collection
  'cache'
  """

  collection = "cache"


class Intermediate(Variable[A]):
  """A value kept for inspection, such as an activation (collection ``"intermediates"``).

  Args:
    value: the value kept, usually a tuple of the values ``Module.sow`` collected.
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import jax.numpy as jnp, statefulremat as sr
  >>> sr.Intermediate(jnp.zeros(3)).collection
  'intermediates'
  """

  collection = "intermediates"


class RngState(Variable[A]):
  """Base kind of the state of an RNG stream (collection ``"rngs"``).

  Args:
    value: the stream's state (a key or a count).
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import statefulremat as sr
  >>> sr.RngKey.collection, sr.RngCount.collection
  ('rngs', 'rngs')
  """

  collection = "rngs"


class RngKey(RngState[A]):
  """The base key of an RNG stream (a typed ``jax.random.key``).

  Args:
    value: the key, a typed ``jax.random.key``.
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import statefulremat as sr
  >>> type(sr.Rngs(0).default.key).__name__
  'RngKey'
  """


class RngCount(RngState[A]):
  """How many keys an RNG stream has handed out (a uint32 scalar).

  Args:
    value: the count, a uint32 scalar array.
    **metadata: free-form attributes kept beside it (``sharding=``, ...), as
      ``sr.Variable`` takes them; none by default.

  >>> import statefulremat as sr
  >>> rngs = sr.Rngs(0)
  >>> _ = rngs.params(), rngs.params()
  >>> int(rngs.default.count.value)
  2
  """

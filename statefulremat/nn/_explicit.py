"""Output shardings of the layers under explicit mesh axes.

With ``jax.make_mesh``'s default ``AxisType.Explicit`` axes, an array's type carries
where it lives (``jax.typeof(x).sharding.spec``), and an op whose output placement is
ambiguous (a contraction over a sharded axis, a gather from a sharded table, a random
draw that has no input) must be told it: ``out_sharding=``. A layer derives it as the
logical rules mean it: the output keeps the input's batch axes and takes the
parameter's feature axes, each mesh axis once.

Under ``AxisType.Auto`` axes, or with no mesh, every spec in the types is empty
(``explicit_specs`` gives ``None``) and the layers take exactly the path they take
without a mesh: the same program, for the cost of reading the types.

>>> import jax.numpy as jnp
>>> from statefulremat.nn._explicit import explicit_specs
>>> explicit_specs("Linear", inputs=jnp.ones((2, 3)), kernel=jnp.ones((3, 4))) is None
True
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..core._errors import StateMismatchError, describe_mesh


class Specs(tuple):
  """Each array's spec (one entry per dimension), and ``mesh``: the mesh they share."""

  mesh: jax.sharding.AbstractMesh


def explicit_specs(layer: str, **arrays) -> Specs | None:
  """Each array's spec, one entry per dimension, or ``None`` if none has explicit axes.

  ``None`` covers no mesh, an ``AxisType.Auto`` mesh (whose axes never show in a
  type) and explicitly replicated arrays: none of them needs an ``out_sharding``.
  Arrays on two different meshes raise a ``StateMismatchError`` naming ``layer``'s
  variable (keyword names are the layer's attribute names) and the fix.
  """
  # .aval, not jax.typeof: this runs on every call of every layer, and reading the
  # attribute costs a tenth of typeof on a concrete array.
  avals = [_aval(a) for a in arrays.values()]
  for aval in avals:
    if any(aval.sharding.spec):
      break
  else:
    return None
  specs = Specs(tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec)) for a in avals)
  specs.mesh = _one_mesh(layer, arrays, avals)
  return specs


def _aval(x):
  aval = getattr(x, "aval", None)
  return jax.typeof(x) if aval is None else aval


def _one_mesh(layer: str, arrays: dict, avals: list):
  """The mesh of every array that has one; raises if two differ."""
  named = [
    (name, aval.sharding.mesh) for name, aval in zip(arrays, avals) if not aval.sharding.mesh.empty
  ]
  first, first_mesh = named[0]
  for name, mesh in named[1:]:
    if mesh != first_mesh:
      raise StateMismatchError(
        f"{layer}: `{name}` lives on mesh {describe_mesh(mesh)} but `{first}` on "
        f"{describe_mesh(first_mesh)}; under explicit mesh axes every array of one op "
        "must be on the same mesh. Fix: shard the model on the mesh its inputs use, "
        "`sr.shard(model, mesh, rules)` with the mesh you put the batch on (and "
        "`with jax.set_mesh(mesh):` around the calls)."
      )
  return first_mesh


def sharding_like(entries: Sequence, specs: Specs) -> NamedSharding:
  """A ``NamedSharding`` with the spec ``entries`` (each mesh axis kept only where it
  first appears, ``dedupe``) on the mesh of ``specs`` (from ``explicit_specs``)."""
  return NamedSharding(specs.mesh, PartitionSpec(*dedupe(entries)))


def dedupe(entries: Sequence) -> tuple:
  """``entries`` with each mesh axis kept only where it first appears.

  A mesh axis shards one dimension at most; the input's batch axes come first, so a
  feature axis that the batch already uses is replicated over it.

  >>> from statefulremat.nn._explicit import dedupe
  >>> dedupe(["data", "model", ("data", "model"), None])
  ('data', 'model', None, None)
  """
  used: set = set()
  out = []
  for entry in entries:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(a for a in axes if a not in used)
    used.update(kept)
    out.append(
      entry if kept == axes and kept else None if not kept else kept[0] if len(kept) == 1 else kept
    )
  return tuple(out)


def drop_dims(spec: Sequence, dims: Sequence[int]) -> tuple:
  """``spec`` with the entries of ``dims`` replicated (e.g. broadcast size-1 axes)."""
  dropped = {d % len(spec) for d in dims}
  return tuple(None if i in dropped else e for i, e in enumerate(spec))

"""flax.linen / flax.nnx parameter import and export, by name.

``from_linen(model, variables)`` / ``from_nnx(model, nnx_module_or_state)`` load flax
variables into our modules in place; ``to_linen(model)`` returns linen variables and
``to_nnx(model, nnx_module_or_state)`` writes ours into nnx. Every call checks the
whole mapping first and raises ``InteropError`` naming each variable that does not fit
(missing, unused, wrong collection, shape or dtype) before writing anything.

The mapping:

* **Collections.** ``sr.Param`` <-> ``params``, ``sr.BatchStat`` <-> ``batch_stats``,
  any other kind by its ``collection`` name (``sr.Cache`` <-> ``cache``); in nnx, the
  Variable type linen would name so (``nnx.Param``, ``nnx.BatchStat``, ...). RNG state
  is not part of linen variables and is never transferred to or from linen; with nnx it
  is transferred only when ``collections`` names ``"rngs"``. ``collections=`` selects
  what to transfer (default: every non-RNG collection, each completely).
* **Names.** An attribute is a linen submodule (or variable) name and an nnx attribute.
  Items of a list, tuple or dict attribute: our ``layers[0].kernel`` is linen's
  ``layers_0/kernel`` (how linen's ``setup`` names a list of submodules; dicts give
  ``heads_a``, nested lists ``blocks_1_0``) and nnx's ``layers[0].kernel`` (``nnx.List``
  keys items by index).
* **Stacks.** A stacked module (class form of ``sr.scan`` / ``sr.remat_scan`` /
  ``sr.vmap``) keeps each stacked variable with one flat layer axis of ``L`` layers.
  linen's ``nn.scan`` keeps the same ``(L, ...)`` under the scanned module's name;
  ``nn.remat_scan(lengths=(a, b))`` keeps nested layer axes ``(a, b, ...)`` (no extra
  dict level), layer ``i * b + j`` at ``[i, j]``. ``from_linen`` takes either layout
  whatever our ``lengths``; ``to_linen`` gives the nested one for a ``remat_scan`` stack
  (its own ``lengths``) and the flat one otherwise (``flat_stacks=True``: always flat).
  nnx's scan-over-layers modules (a Block built under ``nnx.vmap``) keep ``(L, ...)``
  arrays: copied as they are.
* **Values.** Shapes and dtypes must match exactly (no silent casts).

>>> import jax, jax.numpy as jnp, flax.linen as nn, statefulremat as sr
>>> class Net(sr.Module):
...   def __init__(self, rngs):
...     self.hidden = sr.nn.Linear(3, 4, rngs=rngs)
...     self.norm = sr.nn.BatchNorm(4, rngs=rngs)
>>> class LinenNet(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.BatchNorm(use_running_average=False, name="norm")(
...         nn.Dense(4, name="hidden")(x))
>>> variables = LinenNet().init(jax.random.key(0), jnp.ones((2, 3)))
>>> net = sr.interop.from_linen(Net(sr.Rngs(0)), variables)
>>> jax.tree.map(jnp.shape, sr.interop.to_linen(net))
{'batch_stats': {'norm': {'mean': (4,), 'var': (4,)}},
 'params': {'hidden': {'bias': (4,), 'kernel': (3, 4)},
            'norm': {'bias': (4,), 'scale': (4,)}}}
"""

from ._linen import from_linen as from_linen
from ._linen import to_linen as to_linen
from ._nnx import from_nnx as from_nnx
from ._nnx import to_nnx as to_nnx
from ._report import InteropError as InteropError

__all__ = ["InteropError", "from_linen", "from_nnx", "to_linen", "to_nnx"]

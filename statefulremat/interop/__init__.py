r"""flax.linen / flax.nnx parameter and state dict import and export, by name.

``from_linen(model, variables)`` / ``from_nnx(model, nnx_module_or_state)`` load flax
variables into our modules in place; ``to_linen(model)`` returns linen variables and
``to_nnx(model, nnx_module_or_state)`` writes ours into nnx.
``from_state_dict(model, flat)`` / ``to_state_dict(model)`` do the same for a flat
``{name: array}`` mapping (safetensors files; ``layout="torch"`` for PyTorch's).
Every call checks the whole mapping first and raises ``sr.StateMismatchError`` naming
each variable that does not fit (missing, unused, two for one, wrong collection, shape or
dtype, with the nearest names) before writing anything.

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
* **Lists of layers.** A stacked variable also takes a list of layers at the
  stack's path, layer ``i`` from ``blocks[i]`` (nnx's ``nnx.List``, a list, linen's
  ``blocks_i``, a state dict's ``blocks.i.…``), and ``to_nnx`` into such a list,
  ``to_linen(unstack=True)`` and ``to_state_dict(unstack=True)`` write one back.
  Layers go by the index ``stack.layer(i)`` takes: layer ``i`` of a pattern stack
  (``sr.scan((Local, Global), ...)``) is ``blocks[i]`` / ``blocks_i`` / ``blocks.i.…``
  (the split into positions, ``i % P`` and ``i // P``, is done here), and a stacked
  array of the other side (linen's ``nn.scan``, nnx's scan-over-layers, our stack's
  state dict) fills a list of layers, or a pattern stack, index by index along its
  first axis. So one regex rename (``{r"^layers\.": "blocks."}``) maps a list, a stack
  and a pattern stack onto each other; when names do not map, the error proposes it.
* **rename.** Every function takes ``rename=``: a callable, or a mapping of regular
  expressions to replacements applied in order like ``re.sub``
  (``{r"^layers\.(\d+)\.": r"blocks.\1."}``). Names are dot-joined paths with list
  indices as numbers, as PyTorch state dicts name them (``layers.3.linear.kernel``);
  for linen, the name inside its collection (``ScanLRNNCell_0.Dense_0.kernel``; the
  collection is matched by kind). Where the other side has names (``from_*``,
  ``to_nnx``'s target) rename maps them to ours; where we make the names
  (``to_linen``, ``to_state_dict``) it maps ours to theirs. A callable may return
  None to leave an entry out. Two names onto one variable, or a variable of ours
  left unfilled, is an error that lists them.
* **PyTorch layout.** ``layout="torch"`` for state dicts: ``Linear.weight`` ``(out,
  in)`` is our ``kernel`` ``(in, out)``, ``Conv.weight`` ``(out, in, *window)`` our
  ``(*window, in, out)``; ``weight`` of Embedding / LayerNorm / RMSNorm / BatchNorm is
  our ``embedding`` / ``scale``, BatchNorm's ``running_mean`` / ``running_var`` our
  ``mean`` / ``var``. Other layers keep our layout and names.
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

from ..core._errors import folded as _folded
from ._linen import from_linen as from_linen
from ._linen import to_linen as to_linen
from ._nnx import from_nnx as from_nnx
from ._nnx import to_nnx as to_nnx
from ._state_dict import from_state_dict as from_state_dict
from ._state_dict import to_state_dict as to_state_dict

__all__ = [
  "from_linen",
  "from_nnx",
  "from_state_dict",
  "to_linen",
  "to_nnx",
  "to_state_dict",
]


def __getattr__(name: str):
  # sr.interop.InteropError, folded into sr.StateMismatchError: importable, with a
  # warning, for one release.
  if name == "InteropError":
    return _folded(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

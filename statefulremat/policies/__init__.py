"""Remat policies by name: MaxText's presets, a custom policy, and JAX's own policies.

``sr.nn``'s layers name the tensors that matter for memory with
``jax.ad_checkpoint.checkpoint_name`` (``query_proj``, ``key_proj``, ``value_proj``,
``context``, ``out_proj`` in ``MultiHeadAttention``; ``mlpwi``, ``mlpwo`` in ``MLP``;
``conv_out`` in ``Conv`` / ``ConvTranspose``), with MaxText's names, so MaxText's
``remat_policy`` presets work on blocks built from them. Each preset is an attribute
here (``sr.policies.minimal``) and ``sr.policies.preset(name)``; ``custom`` sets each
name to ``"remat"``, ``"device"`` or ``"offload"``. They are built on the public
``jax.checkpoint_policies`` only, by names, so they hold under either remat
implementation. ``sr.saved_residuals`` shows what one keeps for a given block.

A preset names a whole transformer's tensors; a block may give only some of them (an
MLP-only block under ``minimal``). ``sr.remat`` then keeps the ones it gives, and
raises only when the block gives *none* of the preset's names (it would save nothing).

JAX's policies are here too, as ``jax.checkpoint_policies`` has them:
``everything_saveable``, ``nothing_saveable``, ``dots_saveable``, ``checkpoint_dots``,
``dots_with_no_batch_dims_saveable``, ``checkpoint_dots_with_no_batch_dims``,
``save_only_these_names``, ``save_any_names_but_these``,
``save_and_offload_only_these_names``, ``offload_dot_with_no_batch_dims``,
``save_from_both_policies``. (Not ``save_anything_except_these_names``: it ignores its
names and saves every value; ``save_any_names_but_these`` is the one that works.)

>>> import jax, jax.numpy as jnp, statefulremat as sr
>>> Block = sr.remat(sr.nn.MLP, policy=sr.policies.minimal)
>>> mlp = Block(4, 16, rngs=sr.Rngs(0))
>>> [r.name for r in sr.saved_residuals(mlp, jnp.ones((2, 4))) if r.name]  # mlpwo: the output
['mlpwi']
"""

import jax as _jax

from ..core._bookkeeping import DEFINED_IN as _DEFINED_IN
from ..transforms.memory import Policy as Policy
from ._presets import custom as custom
from ._presets import full as full
from ._presets import minimal as minimal
from ._presets import minimal_offloaded as minimal_offloaded
from ._presets import minimal_with_context as minimal_with_context
from ._presets import preset as preset
from ._presets import qkv_proj_offloaded as qkv_proj_offloaded
from ._presets import save_dot_except_mlp as save_dot_except_mlp
from ._presets import save_dot_except_mlpwi as save_dot_except_mlpwi
from ._presets import save_dot_with_context_except_mlp as save_dot_with_context_except_mlp
from ._presets import save_out_proj as save_out_proj
from ._presets import save_qkv_proj as save_qkv_proj

_jax_policies = _jax.checkpoint_policies
checkpoint_dots = _jax_policies.checkpoint_dots
checkpoint_dots_with_no_batch_dims = _jax_policies.checkpoint_dots_with_no_batch_dims
dots_saveable = _jax_policies.dots_saveable
dots_with_no_batch_dims_saveable = _jax_policies.dots_with_no_batch_dims_saveable
everything_saveable = _jax_policies.everything_saveable
nothing_saveable = _jax_policies.nothing_saveable
offload_dot_with_no_batch_dims = _jax_policies.offload_dot_with_no_batch_dims
save_and_offload_only_these_names = _jax_policies.save_and_offload_only_these_names
save_any_names_but_these = _jax_policies.save_any_names_but_these
save_from_both_policies = _jax_policies.save_from_both_policies
save_only_these_names = _jax_policies.save_only_these_names

# Pickles and reprs name the public path (statefulremat.policies.Policy); the file it is
# defined in stays its DEFINED_IN, for doctest's finder and Sphinx.
setattr(Policy, _DEFINED_IN, Policy.__module__)
Policy.__module__ = __name__

__all__ = [
  "Policy",
  "checkpoint_dots",
  "checkpoint_dots_with_no_batch_dims",
  "custom",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "everything_saveable",
  "full",
  "minimal",
  "minimal_offloaded",
  "minimal_with_context",
  "nothing_saveable",
  "offload_dot_with_no_batch_dims",
  "preset",
  "qkv_proj_offloaded",
  "save_and_offload_only_these_names",
  "save_any_names_but_these",
  "save_dot_except_mlp",
  "save_dot_except_mlpwi",
  "save_dot_with_context_except_mlp",
  "save_from_both_policies",
  "save_only_these_names",
  "save_out_proj",
  "save_qkv_proj",
]

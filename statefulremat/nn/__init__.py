"""PyTorch-like layers, named as flax.nnx names them so parameters map one to one.

>>> import jax.numpy as jnp, statefulremat as sr
>>> sr.nn.Linear(3, 2, rngs=sr.Rngs(0))(jnp.ones((1, 3))).shape
(1, 2)
"""

from jax.nn import celu as celu
from jax.nn import elu as elu
from jax.nn import gelu as gelu
from jax.nn import glu as glu
from jax.nn import hard_sigmoid as hard_sigmoid
from jax.nn import hard_silu as hard_silu
from jax.nn import hard_swish as hard_swish
from jax.nn import hard_tanh as hard_tanh
from jax.nn import identity as identity
from jax.nn import leaky_relu as leaky_relu
from jax.nn import log_sigmoid as log_sigmoid
from jax.nn import log_softmax as log_softmax
from jax.nn import logsumexp as logsumexp
from jax.nn import one_hot as one_hot
from jax.nn import relu as relu
from jax.nn import relu6 as relu6
from jax.nn import selu as selu
from jax.nn import sigmoid as sigmoid
from jax.nn import silu as silu
from jax.nn import soft_sign as soft_sign
from jax.nn import softmax as softmax
from jax.nn import softplus as softplus
from jax.nn import standardize as standardize
from jax.nn import swish as swish
from jax.numpy import tanh as tanh

from ..core._bookkeeping import name_public_classes as _name_public_classes
from . import _nnx_names
from . import initializers as initializers
from ._activations import PReLU as PReLU
from ._attention import combine_masks as combine_masks
from ._attention import dot_product_attention as dot_product_attention
from ._attention import dot_product_attention_weights as dot_product_attention_weights
from ._attention import make_attention_mask as make_attention_mask
from ._attention import make_causal_mask as make_causal_mask
from ._cells import GRUCell as GRUCell
from ._cells import LSTMCell as LSTMCell
from ._cells import OptimizedLSTMCell as OptimizedLSTMCell
from ._cells import SimpleCell as SimpleCell
from ._conv import Conv as Conv
from ._conv import ConvTranspose as ConvTranspose
from ._dropout import Dropout as Dropout
from ._dtypes import canonicalize_dtype as canonicalize_dtype
from ._dtypes import promote_dtype as promote_dtype
from ._einsum import Einsum as Einsum
from ._linear import Embed as Embed
from ._linear import Linear as Linear
from ._linear import LinearGeneral as LinearGeneral
from ._lora import LoRA as LoRA
from ._lora import LoRALinear as LoRALinear
from ._lora import LoRAParam as LoRAParam
from ._mlp import MLP as MLP
from ._multi_head_attention import MultiHeadAttention as MultiHeadAttention
from ._normalization import BatchNorm as BatchNorm
from ._normalization import GroupNorm as GroupNorm
from ._normalization import InstanceNorm as InstanceNorm
from ._normalization import LayerNorm as LayerNorm
from ._normalization import RMSNorm as RMSNorm
from ._pooling import avg_pool as avg_pool
from ._pooling import max_pool as max_pool
from ._pooling import min_pool as min_pool
from ._pooling import pool as pool
from ._rnn import RNN as RNN
from ._rnn import Bidirectional as Bidirectional
from ._rnn import RNNCellBase as RNNCellBase
from ._rope import RoPE as RoPE
from ._rope import dot_product_attention_with_rope as dot_product_attention_with_rope
from ._rope import rope as rope
from ._sequential import Sequential as Sequential
from ._weight_norms import SpectralNorm as SpectralNorm
from ._weight_norms import WeightNorm as WeightNorm

# Pickles and reprs name the public path (statefulremat.nn.Linear), not a file that may move.
_name_public_classes(globals(), __name__)
# Every layer holds `promote_dtype` (its default) as an attribute, so a pickled layer
# names the function too: by its public path.
promote_dtype.__module__ = canonicalize_dtype.__module__ = __name__


def __getattr__(name: str):
  # A name at the top of the package (sr.nn.Module) or one nnx or linen spells differently
  # (Dict, tabulate, Dense) says where to go, from the table the package's own __getattr__
  # reads; dunder and private names (probed by pytest, doctest, pickle) and unknown names
  # keep Python's plain AttributeError.
  text = None if name.startswith("_") else _nnx_names.message_in_nn(__name__, name)
  if text is not None:
    raise AttributeError(text, name=name, obj=None)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

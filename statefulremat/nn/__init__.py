"""PyTorch-like layers, named as flax.nnx names them so parameters map one to one.

>>> import jax.numpy as jnp, statefulremat as sr
>>> sr.nn.Linear(3, 2, rngs=sr.Rngs(0))(jnp.ones((1, 3))).shape
(1, 2)
"""

from ._attention import combine_masks as combine_masks
from ._attention import dot_product_attention as dot_product_attention
from ._attention import dot_product_attention_weights as dot_product_attention_weights
from ._attention import make_attention_mask as make_attention_mask
from ._attention import make_causal_mask as make_causal_mask
from ._batchnorm import BatchNorm as BatchNorm
from ._conv import Conv as Conv
from ._dropout import Dropout as Dropout
from ._embed import Embed as Embed
from ._linear import Linear as Linear
from ._linear_general import LinearGeneral as LinearGeneral
from ._mlp import MLP as MLP
from ._multi_head_attention import MultiHeadAttention as MultiHeadAttention
from ._normalization import LayerNorm as LayerNorm
from ._normalization import RMSNorm as RMSNorm

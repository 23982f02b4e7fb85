"""PyTorch-like layers, named as flax.nnx names them so parameters map one to one."""

from ._linear import Linear as Linear

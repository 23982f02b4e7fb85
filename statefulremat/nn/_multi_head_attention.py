"""MultiHeadAttention: projections to heads, dot-product attention, projection back; and
the key/value cache it decodes with.

``init_cache`` (the layer's method) makes three ``Cache`` Variables: ``cached_key``,
``cached_value`` (``(batch..., max_length, num_kv_heads, head_dim)``) and
``cache_index``, the next position. A decoding call feeds one position: ``cache_slot``
checks the step against the cache and finds the position it goes to (raising, rather
than letting ``dynamic_update_slice`` clamp a write past the end onto the last
position); ``cache_write`` writes it there and returns the keys and values cached so
far with the mask that lets the query see exactly them.

Under explicit mesh axes the step is written where the cache lives, and the keys and
values cached so far are read back where the step's were (the projections' placement),
so the attention gets them placed as it does without decoding: its contractions need
the keys' and values' batch and head axes sharded exactly as the queries' (jax 0.12
refuses a replicated operand against a sharded one, which earlier versions let pass).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.core import Tracer

from ..core._errors import format_path
from ..core._frozen import EMPTY as _EMPTY
from ..core._kinds import Cache
from ..core._module import Module
from ..core._rngs import Rngs, RngStream
from ..core._stacks import per_layer
from ..core._variables import Variable, path_of
from ._attention import call_attention_fn, check_attention_fn, combine_masks, dot_product_attention
from ._dropout import draw_key
from ._dtypes import promote_dtype as default_promote_dtype
from ._explicit import explicit_specs
from ._linear import Initializer, LinearGeneral, default_kernel_init, named
from ._normalization import LayerNorm
from ._rngs_arg import check_rngs
from ._rope import check_positions, is_real, rope


class MultiHeadAttention(Module):
  """Multi-head (and grouped-query) attention, as ``flax.nnx.MultiHeadAttention``.

  Sub-layers and parameter shapes are nnx's, so parameters map one to one:
  ``query`` (``LinearGeneral`` with kernel ``(in_features, num_heads, head_dim)``),
  ``key`` / ``value`` (``(in_kv_features, num_kv_heads, head_dim)``), ``out``
  (``(num_heads, head_dim, out_features)``), and, with ``normalize_qk``,
  ``query_ln`` / ``key_ln`` (``LayerNorm(head_dim, use_bias=False)``).
  ``head_dim = qkv_features // num_heads``.

  Called with one input it is self-attention; ``(inputs_q, inputs_k)`` and
  ``(inputs_q, inputs_k, inputs_v)`` are cross-attention (a missing ``inputs_v`` is
  ``inputs_k``). ``mask`` (``[batch..., heads or 1, q_len, kv_len]``, False = do not
  attend) comes from ``make_attention_mask`` / ``make_causal_mask``.

  Grouped-query attention (Llama 2 70B, Llama 3, Gemma): with ``num_kv_heads`` a
  divisor of ``num_heads``, ``key`` / ``value`` project to ``num_kv_heads`` heads and
  kv head ``j`` serves query heads ``j * g ... (j + 1) * g - 1``, ``g = num_heads //
  num_kv_heads`` (as repeating each kv head ``g`` times); the decoding cache holds
  ``num_kv_heads`` heads. ``num_kv_heads == num_heads`` is plain multi-head attention.

  Rotary embeddings: with ``rope_base`` a float, ``sr.nn.rope`` (Gemma's and Llama's
  "rotate half") rotates the projected queries and keys (after ``normalize_qk``'s
  LayerNorms) by ``positions``, a call argument: ``[batch..., length]`` or
  ``[length]``, by default ``arange(length)``; while decoding, the cache index (the
  position being written), and the cache stores the rotated keys. Keys take the
  queries' positions, so rope is for self-attention (key length = query length).

  Differences from nnx: a ``decode=None`` layer runs without the cache (nnx raises);
  the ``rngs`` kept for attention dropout is the one given, shared, not a fork (it
  draws ``self.rngs["dropout"]()``); the deprecated ``*_dot_general*`` arguments and
  the ``sow_weights`` call argument (which adds a Variable while running) are left
  out.

  Memory names, MaxText's (``jax.ad_checkpoint.checkpoint_name``, what remat policies
  such as ``sr.policies.minimal`` save by): ``query_proj``, ``key_proj`` and
  ``value_proj``, the projected queries, keys and values as attention reads them
  (after ``normalize_qk`` and rope); ``context``, attention's output before the output
  projection (``[batch..., q_len, num_heads, head_dim]``); ``out_proj``, the layer's
  output.

  Args:
    num_heads: number of query heads.
    in_features: size of ``inputs_q``'s last axis.
    qkv_features: total query/key/value size (default ``in_features``); divisible
      by ``num_heads``.
    out_features: output size (default ``in_features``).
    num_kv_heads: key/value heads (default ``num_heads``); fewer means grouped-query
      attention. Must divide ``num_heads``.
    in_kv_features: size of ``inputs_k`` / ``inputs_v``'s last axis (default
      ``in_features``).
    dtype: computation dtype of the projections and attention; default ``None``:
      inferred from the inputs and parameters.
    param_dtype: dtype the parameters are initialised in (default ``jnp.float32``).
    broadcast_dropout: one attention-dropout mask across batch and heads (default
      ``True``).
    dropout_rate: attention-dropout rate (default ``0.0``: none).
    deterministic: evaluation mode for dropout (``model.train()`` / ``eval()`` flip it;
      the call argument overrides it); default ``None``: unset, which a call with
      dropout refuses.
    precision: ``lax.Precision`` of the projections and attention (default ``None``).
    kernel_init: initialiser of the ``query``, ``key`` and ``value`` kernels (default
      ``jax.nn.initializers.lecun_normal()``).
    out_kernel_init: initialiser of ``out``'s kernel; default ``None``: ``kernel_init``.
    bias_init: initialiser of the ``query``, ``key`` and ``value`` biases (default
      zeros).
    out_bias_init: initialiser of ``out``'s bias; default ``None``: ``bias_init``.
    use_bias: give the projections biases (default ``True``).
    attention_fn: ``dot_product_attention`` or another attention function: flax's
      ``flax.nnx.dot_product_attention`` and ``flax.linen.dot_product_attention``,
      ``jax.nn.dot_product_attention``, or yours. It is called with ``query, key,
      value`` and those of the options ``mask``, ``is_causal``, ``dropout_rng``,
      ``dropout_rate``, ``broadcast_dropout``, ``deterministic``, ``dtype`` and
      ``precision`` its signature takes (all of them for ``**kwargs``); without
      ``is_causal``, causality reaches it as part of ``mask``. Dropout or
      ``precision`` it does not take is an error, not dropped. With grouped-query
      attention it must take fewer key/value heads than query heads (linen's does
      not).
    rope_base: ``None`` (no rotary embeddings, nnx's layer) or the ``base`` of
      ``sr.nn.rope`` applied to queries and keys (10000.0 for Llama 2 and Gemma);
      ``head_dim`` must be even. Not an nnx argument; it adds no parameters.
    decode: autoregressive decoding with a key/value cache (see ``init_cache``);
      default ``None``: no cache unless the call asks for it.
    normalize_qk: LayerNorm the projected queries and keys (ViT-22B; default
      ``False``).
    qkv_promote_dtype: promotion function of ``query``, ``key`` and ``value`` (default
      ``sr.nn.promote_dtype``).
    out_promote_dtype: promotion function of ``out`` (default ``sr.nn.promote_dtype``).
    ln_promote_dtype: promotion function of ``query_ln`` and ``key_ln`` (default
      ``sr.nn.promote_dtype``).
    rngs: draws the projections' parameters; kept for dropout if ``keep_rngs``.
    keep_rngs: store ``rngs`` (when ``dropout_rate > 0``) as ``self.rngs`` (default
      ``True``).
    kernel_metadata: metadata of the ``query``, ``key`` and ``value`` kernels (and of
      ``out``'s unless ``out_kernel_metadata`` is given; default ``{}``: none).
    out_kernel_metadata: metadata of ``out``'s kernel (default ``{}``:
      ``kernel_metadata``).
    bias_metadata: metadata of the ``query``, ``key`` and ``value`` biases (and of
      ``out``'s unless ``out_bias_metadata`` is given; default ``{}``: none).
    out_bias_metadata: metadata of ``out``'s bias (default ``{}``: ``bias_metadata``).
    query_ln_scale_metadata: metadata of ``query_ln.scale`` (default ``{}``: none).
    key_ln_scale_metadata: metadata of ``key_ln.scale`` (default ``{}``: none).

  Raises:
    TypeError: when ``rngs`` is not an ``sr.Rngs``, or ``attention_fn`` is not callable.
    ValueError: when ``num_kv_heads`` does not divide ``num_heads``, ``num_heads`` does
      not divide ``qkv_features``, ``rope_base`` is not a positive number or ``head_dim``
      is odd with it, or ``attention_fn`` takes no dropout arguments with
      ``dropout_rate > 0`` (or no ``precision`` with one given).

  >>> import jax, jax.numpy as jnp, statefulremat as sr
  >>> attn = sr.nn.MultiHeadAttention(num_heads=2, in_features=8, rngs=sr.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(0), (3, 5, 8))
  >>> attn(x).shape, attn.query.kernel.shape, attn.out.kernel.shape
  ((3, 5, 8), (8, 2, 4), (2, 4, 8))
  >>> mask = sr.nn.make_causal_mask(x[..., 0])
  >>> attn(x, mask=mask).shape
  (3, 5, 8)

  A flax or jax attention function, with the same parameters (the same seed); flax.linen's
  takes no ``is_causal``, and gets causality as a mask:

  >>> import flax.linen
  >>> ported = sr.nn.MultiHeadAttention(2, 8, attention_fn=flax.linen.dot_product_attention,
  ...                                   rngs=sr.Rngs(0))
  >>> bool(jnp.allclose(ported(x, is_causal=True), attn(x, is_causal=True), atol=1e-6))
  True

  Grouped-query attention with rotary embeddings, 4 query heads sharing 2 kv heads:

  >>> gqa = sr.nn.MultiHeadAttention(4, 16, num_kv_heads=2, rope_base=10000.0,
  ...                                rngs=sr.Rngs(0))
  >>> gqa.query.kernel.shape, gqa.key.kernel.shape
  ((16, 4, 4), (16, 2, 4))
  >>> x = jax.random.normal(jax.random.key(0), (3, 5, 16))
  >>> gqa(x, is_causal=True).shape, gqa(x, positions=jnp.arange(10, 15)).shape
  ((3, 5, 16), (3, 5, 16))
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    broadcast_dropout: bool = True,
    dropout_rate: float = 0.0,
    deterministic: bool | None = None,
    precision: Any = None,
    kernel_init: Initializer = default_kernel_init,
    out_kernel_init: Initializer | None = None,
    bias_init: Initializer = jax.nn.initializers.zeros,
    out_bias_init: Initializer | None = None,
    use_bias: bool = True,
    attention_fn: Callable = dot_product_attention,
    rope_base: float | None = None,
    decode: bool | None = None,
    normalize_qk: bool = False,
    qkv_promote_dtype: Callable = default_promote_dtype,
    out_promote_dtype: Callable = default_promote_dtype,
    ln_promote_dtype: Callable = default_promote_dtype,
    rngs: Rngs,
    keep_rngs: bool = True,
    kernel_metadata: Mapping[str, Any] = _EMPTY,
    out_kernel_metadata: Mapping[str, Any] = _EMPTY,
    bias_metadata: Mapping[str, Any] = _EMPTY,
    out_bias_metadata: Mapping[str, Any] = _EMPTY,
    query_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
    key_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
  ):
    check_rngs("MultiHeadAttention", rngs)
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = qkv_features if qkv_features is not None else in_features
    self.out_features = out_features if out_features is not None else in_features
    self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
    self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
    if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
      divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
      raise ValueError(
        f"MultiHeadAttention(num_heads={num_heads}, num_kv_heads={self.num_kv_heads}): "
        f"num_heads ({num_heads}) must be divisible by num_kv_heads "
        f"({self.num_kv_heads}), each kv head serving num_heads // num_kv_heads "
        f"query heads. Fix: pick num_kv_heads from {divisors} (num_kv_heads="
        f"{num_heads} is plain multi-head attention)."
      )
    if self.qkv_features % self.num_heads:
      raise ValueError(
        f"MultiHeadAttention: qkv_features ({self.qkv_features}) must be "
        f"divisible by num_heads ({num_heads})."
      )
    self.head_dim = self.qkv_features // self.num_heads
    if rope_base is not None:
      if not is_real(rope_base) or not rope_base > 0:
        raise ValueError(
          f"MultiHeadAttention: rope_base={rope_base!r} must be a positive number, the "
          "base of the rotary embeddings' wavelengths. Fix: rope_base=10000.0 (Llama "
          "2, Gemma), 500000.0 (Llama 3), or None for no rotary embeddings."
        )
      if self.head_dim % 2:
        raise ValueError(
          f"MultiHeadAttention(num_heads={num_heads}, qkv_features="
          f"{self.qkv_features}, rope_base={rope_base}): rope rotates pairs of the "
          f"head dimension, but head_dim = qkv_features // num_heads = "
          f"{self.head_dim} is odd. Fix: choose qkv_features so that qkv_features // "
          f"num_heads is even (e.g. qkv_features={2 * self.qkv_features}), or "
          "rope_base=None."
        )
    self.rope_base = None if rope_base is None else float(rope_base)
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.broadcast_dropout = broadcast_dropout
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.precision = precision
    self.use_bias = use_bias
    check_attention_fn(
      "MultiHeadAttention", attention_fn, dropout_rate=dropout_rate, precision=precision
    )
    self.attention_fn = attention_fn
    self.decode = decode
    self.normalize_qk = normalize_qk
    self.qkv_promote_dtype = qkv_promote_dtype
    self.out_promote_dtype = out_promote_dtype
    self.ln_promote_dtype = ln_promote_dtype

    linear = functools.partial(
      LinearGeneral,
      dtype=dtype,
      param_dtype=param_dtype,
      kernel_init=kernel_init,
      bias_init=bias_init,
      use_bias=use_bias,
      precision=precision,
      promote_dtype=qkv_promote_dtype,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
      rngs=rngs,
    )
    self.query = linear(in_features, (self.num_heads, self.head_dim))
    self.key = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim))
    self.value = linear(self.in_kv_features, (self.num_kv_heads, self.head_dim))
    if normalize_qk:
      norm = functools.partial(
        LayerNorm,
        self.head_dim,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        promote_dtype=ln_promote_dtype,
        rngs=rngs,
      )
      self.query_ln = norm(scale_metadata=query_ln_scale_metadata)
      self.key_ln = norm(scale_metadata=key_ln_scale_metadata)
    else:
      self.query_ln = self.key_ln = None
    self.out = linear(
      (self.num_heads, self.head_dim),
      self.out_features,
      axis=(-2, -1),
      kernel_init=out_kernel_init or kernel_init,
      bias_init=out_bias_init or bias_init,
      promote_dtype=out_promote_dtype,
      kernel_metadata=out_kernel_metadata or kernel_metadata,
      bias_metadata=out_bias_metadata or bias_metadata,
    )
    self.rngs = rngs if keep_rngs and dropout_rate > 0 else None
    self.cached_key: Variable | None = None  # Cache Variables, made by init_cache
    self.cached_value: Variable | None = None
    self.cache_index: Variable | None = None

  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    mask: jax.Array | None = None,
    deterministic: bool | None = None,
    rngs: Rngs | RngStream | jax.Array | None = None,
    decode: bool | None = None,
    is_causal: bool = False,
    out_sharding: Any = None,
    qkv_sharding: Any = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """Attends from ``inputs_q`` ``[batch..., q_len, in_features]`` to ``inputs_k``/``_v``.

    ``deterministic``, ``rngs`` (an ``sr.Rngs``, whose ``dropout`` stream is drawn,
    an ``sr.RngStream`` or a key) and ``decode`` override the layer's for this call;
    ``is_causal`` overlays a causal mask. Under ``decode`` the cache's own mask (the
    positions decoded so far) is already causal, so ``is_causal`` is ignored there and
    one block's code both trains (whole sequences) and decodes (one position at a
    time). ``positions`` (``[batch..., q_len]`` or ``[q_len]``, only with
    ``rope_base``) are the tokens' positions for the rotary embeddings; by default
    ``arange(q_len)``, or the cache index when decoding. Returns ``[batch..., q_len,
    out_features]``.
    """
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError(
          "MultiHeadAttention: inputs_k cannot be None when inputs_v is given. To "
          "use one array for both, pass it as inputs_k and leave inputs_v None."
        )
      inputs_k = inputs_q
    inputs_v = inputs_k if inputs_v is None else inputs_v
    self._check_inputs(inputs_q, inputs_k, inputs_v)
    if positions is not None and self.rope_base is None:
      raise ValueError(
        f"{self._where()}: positions= was given but the layer has no rotary "
        "embeddings (rope_base=None), so the positions would be ignored. Fix: build "
        "it with rope_base=10000.0 (or your model's base), or drop positions=."
      )

    query = self.query(inputs_q, out_sharding=qkv_sharding)
    key = self.key(inputs_k, out_sharding=qkv_sharding)
    value = self.value(inputs_v, out_sharding=qkv_sharding)
    if self.normalize_qk:
      assert self.query_ln is not None and self.key_ln is not None  # made with the flag
      query = self.query_ln(query)
      key = self.key_ln(key)

    decode = self.decode if decode is None else decode
    if decode:
      index = cache_slot(self, key)
      if self.rope_base is not None:
        # The cache stores rotated keys: each is rotated once, at its own position.
        at = index[None] if positions is None else positions
        query, key = self._rotate(query, key, at, self.rope_base)
      key, value, mask = cache_write(self, key, value, index, mask)
      is_causal = False  # the decode mask lets the query see exactly the past
    elif self.rope_base is not None:
      query, key = self._rotate(query, key, positions, self.rope_base)

    dropout_rng = None
    if self.dropout_rate > 0.0:
      deterministic = self.deterministic if deterministic is None else deterministic
      if deterministic is None:
        raise ValueError(
          "MultiHeadAttention has dropout_rate > 0 but its deterministic is None. Set "
          "the mode (`model.train()` / `model.eval()`), build it with "
          "`deterministic=False/True`, or pass `deterministic=` to the call."
        )
      if not deterministic:
        dropout_rng = draw_key(
          rngs if rngs is not None else self.rngs, "dropout", "MultiHeadAttention"
        )
    else:
      deterministic = True

    # Named where MaxText names them: as attention reads them (after normalize_qk and
    # rope, whose backward needs no copy of its input).
    query = checkpoint_name(query, "query_proj")
    key = checkpoint_name(key, "key_proj")
    value = checkpoint_name(value, "value_proj")
    x = call_attention_fn(
      self._where(),
      self.attention_fn,
      query,
      key,
      value,
      mask=mask,
      dropout_rng=dropout_rng,
      dropout_rate=self.dropout_rate,
      broadcast_dropout=self.broadcast_dropout,
      deterministic=deterministic,
      dtype=self.dtype,
      precision=self.precision,
      is_causal=is_causal,
    )
    x = checkpoint_name(x, "context")
    return checkpoint_name(self.out(x, out_sharding=out_sharding), "out_proj")

  def _check_inputs(self, inputs_q, inputs_k, inputs_v) -> None:
    """Raises, naming the layer's path and the expected shape, on inputs that do not
    fit the projections."""
    for name, x, features, attr in (
      ("inputs_q", inputs_q, self.in_features, "in_features"),
      ("inputs_k", inputs_k, self.in_kv_features, "in_kv_features"),
      ("inputs_v", inputs_v, self.in_kv_features, "in_kv_features"),
    ):
      if x.ndim < 2:
        raise ValueError(
          f"{self._where()} takes {name} of shape [batch..., length, {features}], got "
          f"shape {tuple(x.shape)}. Fix: add the length axis, e.g. `x[None]` for a "
          "single sequence."
        )
      if x.shape[-1] != features:
        raise ValueError(
          f"{self._where()} was built with {attr}={features} but {name} has shape "
          f"{tuple(x.shape)}: expected [batch..., length, {features}]. Fix the input, "
          f"or build the layer with {attr}={x.shape[-1]}."
        )

  def _rotate(
    self, query: jax.Array, key: jax.Array, positions: jax.Array | None, base: float
  ) -> tuple[jax.Array, jax.Array]:
    """``sr.nn.rope`` of ``base`` on queries and keys, both at ``positions`` (default
    arange)."""
    if key.shape[-3] != query.shape[-3]:
      raise ValueError(
        f"{self._where()}: rope_base is set, and keys take the queries' positions, "
        f"but inputs_k has length {key.shape[-3]} and inputs_q {query.shape[-3]}. "
        "Fix: rope is for self-attention; for cross-attention build the layer with "
        "rope_base=None (and rotate inside an attention_fn if you need to)."
      )
    if positions is None:
      positions = jnp.arange(query.shape[-3])
    else:
      check_positions(self._where(), positions, query.shape)
    return rope(query, positions, base=base), rope(key, positions, base=base)

  def _where(self) -> str:
    return named("MultiHeadAttention", self)

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
    """Creates the ``Cache`` Variables for decoding inputs ``(batch..., max_length, features)``.

    Call it outside any transform (it adds Variables), then call the layer with
    ``decode=True`` one position (length 1) at a time; calling it again starts a new
    sequence. ``cached_key`` / ``cached_value`` have shape ``(batch..., max_length,
    num_kv_heads, head_dim)`` and ``cache_index`` (the next position) shape ``()``.

    On the attention of a stack (``stack.attn``, whose Variables carry the layer
    axis) it makes one cache per layer, stacked along the layer axis in front:
    shapes ``(num_layers, ...)`` with the ``layer_axis`` metadata, so ``sr.state``,
    checkpoints, ``stack.layer(i)`` and the scan over the stack treat them as stacked,
    and each layer decodes with its own slice. The stack's rules must slice the
    ``Cache`` collection along axis 0: ``sr.remat_scan``'s default ``{True: 0}``
    does; give ``sr.scan`` ``variable_axes={True: 0}`` or ``{sr.Param: 0, sr.Cache:
    0}`` (linen's ``{'params': 0, 'cache': 0}``).

    >>> import jax.numpy as jnp, statefulremat as sr
    >>> attn = sr.nn.MultiHeadAttention(2, 4, decode=True, rngs=sr.Rngs(0))
    >>> attn.init_cache((1, 6, 4))
    >>> attn(jnp.ones((1, 1, 4))).shape, int(attn.cache_index.value)
    ((1, 1, 4), 1)

    A stack of three attention layers decodes with a cache per layer:

    >>> Stack = sr.remat_scan(sr.nn.MultiHeadAttention, lengths=(3,))
    >>> stack = Stack(2, 4, decode=True, rngs=sr.Rngs(0))
    >>> stack.init_cache((1, 6, 4))
    >>> stack.cached_key.shape, stack.cache_index.value.tolist()
    ((3, 1, 6, 2, 2), [0, 0, 0])
    >>> stack(jnp.ones((1, 1, 4))).shape, stack.cache_index.value.tolist()
    ((1, 1, 4), [1, 1, 1])
    >>> len(stack), stack.layer(0).cached_key.shape
    (3, (1, 6, 2, 2))
    """
    shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
    self.cached_key = per_layer(self, Cache(jnp.zeros(shape, dtype)))
    self.cached_value = per_layer(self, Cache(jnp.zeros(shape, dtype)))
    self.cache_index = per_layer(self, Cache(jnp.array(0, dtype=jnp.int32)))


def _cache(layer: MultiHeadAttention) -> tuple[Variable, Variable, Variable]:
  cached_key, cached_value, cache_index = layer.cached_key, layer.cached_value, layer.cache_index
  if cached_key is None or cached_value is None or cache_index is None:
    raise ValueError(
      f"{layer._where()}: decode=True needs the key/value cache, and it has none. "
      f"Fix: call `init_cache((batch, max_length, {layer.in_features}))` on it "
      "before decoding, outside any transform (it creates Variables); on a stack, "
      "`stack.attn.init_cache(...)` makes one cache per layer, stacked along the "
      "layer axis (on a pattern stack, once per position: "
      "`stack.pattern[k].attn.init_cache(...)`)."
    )
  return cached_key, cached_value, cache_index


def cache_slot(layer: MultiHeadAttention, key: jax.Array) -> jax.Array:
  """Checks one decoding step's ``key`` against the cache; returns the position it goes to."""
  cached_key, _, cache_index = _cache(layer)
  *batch_dims, max_length, num_kv_heads, depth = cached_key.shape
  cached, batch = tuple(batch_dims), tuple(key.shape[:-3])
  if batch != cached:
    raise ValueError(_batch_mismatch(layer, cached_key, batch, max_length))
  expected = cached + (1, num_kv_heads, depth)
  if key.shape != expected:
    raise ValueError(
      f"{layer._where()}: decode=True feeds one position at a time, but the input has "
      f"length {key.shape[-3]} (key of shape {key.shape}, expected {expected}). Fix: "
      "call it once per position, with inputs of shape (batch..., 1, "
      f"{layer.in_features}); to fill the cache with a prompt, decode its positions one "
      "by one."
    )
  return _check_room(layer, cache_index.value, max_length)


def _batch_mismatch(
  layer: MultiHeadAttention, cached_key: Variable, batch: tuple, max_length: int
) -> str:
  """The message for a decoding step whose batch is not the one the cache was made for."""

  def of(dims: tuple) -> str:
    return f"a batch of {dims[0]}" if len(dims) == 1 else f"a batch of shape {dims}"

  cached = tuple(cached_key.shape[:-3])
  path = path_of(cached_key)
  where = f"`{format_path(path)}`" if path else "its `cached_key`"
  shape = f"({', '.join(map(str, batch + (max_length, layer.in_features)))})"
  return (
    f"{layer._where()}: decoding {of(batch) if batch else 'an input without a batch axis'}"
    f" into a key/value cache made for {of(cached) if cached else 'no batch axis'} "
    f"({where} has shape {tuple(cached_key.shape)}: batch..., max_length, num_kv_heads, "
    f"head_dim). Fix: make the cache for this batch, `init_cache({shape})` (it starts a "
    f"new sequence); on a stack, `stack.attn.init_cache({shape})`, on a pattern stack "
    f"for each position k, `stack.pattern[k].attn.init_cache({shape})`. Or decode "
    f"{of(cached) if cached else 'inputs without a batch axis'}, as the cache was made."
  )


def cache_write(
  layer: MultiHeadAttention,
  key: jax.Array,
  value: jax.Array,
  index: jax.Array,
  mask: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Writes ``key`` / ``value`` at ``index`` and moves the index on; returns the cached
  keys and values (placed where ``key`` / ``value`` were) and ``mask`` combined with the
  positions cached so far."""
  cached_key, cached_value, cache_index = _cache(layer)
  *batch_dims, max_length, _, _ = cached_key.shape
  step_shardings = None
  if explicit_specs(
    "MultiHeadAttention",
    key=key,
    value=value,
    cached_key=cached_key.value,
    cached_value=cached_value.value,
  ):
    # Explicit mesh axes: the step is written where the cache lives (init_cache
    # makes it replicated; sr.shard or a reshard may place it otherwise) ...
    step_shardings = jax.typeof(key).sharding, jax.typeof(value).sharding
    key = jax.sharding.reshard(key, jax.typeof(cached_key.value).sharding)
    value = jax.sharding.reshard(value, jax.typeof(cached_value.value).sharding)
  zero = jnp.array(0, dtype=lax.dtype(index.dtype))
  indices = (zero,) * len(batch_dims) + (index, zero, zero)
  key = lax.dynamic_update_slice(cached_key.value, key, indices)
  value = lax.dynamic_update_slice(cached_value.value, value, indices)
  cached_key.value = key
  cached_value.value = value
  cache_index.value = index + 1
  if step_shardings is not None:
    # ... and read back where the step was, the queries' batch and head placement
    # (a replicated cache is sliced locally, one placed as the step is left as is).
    key = jax.sharding.reshard(key, step_shardings[0])
    value = jax.sharding.reshard(value, step_shardings[1])
  # The single query may attend only to the positions already cached.
  mask = combine_masks(
    mask,
    jnp.broadcast_to(jnp.arange(max_length) <= index, tuple(batch_dims) + (1, 1, max_length)),
  )
  return key, value, mask


def _check_room(layer: MultiHeadAttention, index: jax.Array, max_length: int) -> jax.Array:
  """Raises when every cache position is used: a write there would be clamped
  onto the last position (``dynamic_update_slice``), a silently wrong result.
  Returns ``index``."""

  def report(index, where=None):  # eager: the path is read only when it raises
    if (np.asarray(index) >= max_length).any():
      raise ValueError(
        f"{where or layer._where()}: decoding past the end of the key/value cache: "
        f"it holds max_length={max_length} positions and all are used (cache_index="
        f"{int(index.max())}). Fix: give the sequence a longer cache, "
        f"`init_cache((batch, max_length, {layer.in_features}))` with max_length at "
        "least the number of positions decoded (it also starts a new sequence); on "
        "a stack call it on the stack's attention, `stack.attn.init_cache(...)` "
        "(on a pattern stack, `stack.pattern[k].attn.init_cache(...)` per position)."
      )
    return index

  if not isinstance(index, Tracer):
    return report(index)  # eager: raise before anything is written
  # Traced (sr.jit, a stack's scan): the host is called only when the cache is full,
  # and its error stops the call before the transform writes anything back. A
  # pure_callback whose result the write uses, so it is not pruned: the effect of
  # jax.debug.callback cost every decode call ~0.2 ms on CPU where this costs ~0.03.
  # The path is read now: the host call runs after the trace's modules are gone.
  checked = functools.partial(
    jax.pure_callback,
    functools.partial(report, where=layer._where()),
    jax.ShapeDtypeStruct(index.shape, index.dtype),
    vmap_method="broadcast_all",
  )
  return lax.cond(index >= max_length, checked, lambda i: i, index)

"""QuantAttentionProj: quantized Q/K/V and output projections of attention."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers.layers.general import QuantLinearGeneral
from qlayers.recipe import Recipe, recipe as load_recipe

__all__ = ["QuantAttentionProj"]

_default_kernel_init = nnx.initializers.lecun_normal()


class QuantAttentionProj(nnx.Module):
  """The Q/K/V and output projections of attention, each GEMM quantized.

  The attention core (scores, softmax, weighted sum) is not part of this
  module: it stays wide in the caller (see `attend`). Each projection is a
  `QuantLinearGeneral` with its own `QuantGemm` (and, for delayed recipes,
  its own delayed-scaling state).

  Submodules and Params:

  * separate (default): ``query`` ``(in, H, D)``, ``key`` and ``value``
    ``(in_kv, Hkv, D)``, ``out`` ``(H, D, out)`` -- the names, shapes and
    dtypes of ``nnx.MultiHeadAttention``'s projections, so its Params load
    directly (or use `from_multihead`).
  * ``fused_qkv=True``: one GEMM ``query_key_value`` ``(in, H + 2 Hkv, D)``
    (heads of Q, then K, then V), and ``out``.

  Biases (``use_bias``) have the kernels' output shapes. With a recipe that
  quantizes nothing (``"bf16"``) every projection computes what
  ``nnx.LinearGeneral`` computes on BF16 operands with FP32 accumulation.

  Args:
    in_features: input features of the query (and, by default, key/value).
    num_heads: query heads ``H``.
    head_dim: features per head ``D``.
    num_kv_heads: key/value heads ``Hkv`` (grouped-query attention when it
      is smaller than ``num_heads``, which it must divide); default ``H``.
    in_kv_features: input features of key/value (cross-attention; separate
      projections only); default ``in_features``.
    out_features: features of the output projection; default
      ``in_features``.
    fused_qkv: project Q, K and V with one GEMM.
    use_bias: add biases to all projections.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: dtype of the Params (FP32 masters by default).
    precision: kept for ``nnx.MultiHeadAttention``'s signature; the recipe sets
      every projection's operand precision (a wide recipe: its compute dtype).
    kernel_init: initializer of the Q/K/V kernels.
    out_kernel_init: initializer of the output kernel (default
      ``kernel_init``).
    bias_init: initializer of the biases.
    kernel_metadata: metadata of the Q/K/V kernels (e.g. ``{"out_sharding":
      (None, "model", None)}``), as ``nnx.MultiHeadAttention`` takes it.
    out_kernel_metadata: metadata of the output kernel ``(H, D, out)``
      (default ``kernel_metadata``, as in ``nnx.MultiHeadAttention``).
    bias_metadata: metadata of the Q/K/V biases.
    out_bias_metadata: metadata of the output bias.
    rngs: the RNG streams (``params``).
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> proj = qlayers.QuantAttentionProj(32, 4, 8, num_kv_heads=2,
    ...                                   rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(proj, nnx.Param))['key']
    State({
      'kernel': Param(
        value=(32, 2, 8)
      )
    })
    >>> x = jnp.ones((2, 5, 32))
    >>> q, k, v = proj.qkv(x)
    >>> q.shape, k.shape
    ((2, 5, 4, 8), (2, 5, 2, 8))
    >>> proj.out(proj.attend(q, k, v, is_causal=True)).shape
    (2, 5, 32)
  """

  def __init__(self, in_features: int, num_heads: int, head_dim: int, *,
               num_kv_heads: int | None = None,
               in_kv_features: int | None = None,
               out_features: int | None = None, fused_qkv: bool = False,
               use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
               precision=None, kernel_init=_default_kernel_init,
               out_kernel_init=None,
               bias_init=nnx.initializers.zeros_init(),
               kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               out_kernel_metadata: Mapping[str, Any] | None = None,
               bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               rngs: nnx.Rngs,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                       f"num_kv_heads ({num_kv_heads}).")
    if fused_qkv and in_kv_features not in (None, in_features):
      raise ValueError("fused_qkv projects Q, K and V from one input, so "
                       "in_kv_features must equal in_features.")
    in_kv_features = in_features if in_kv_features is None else in_kv_features
    out_features = in_features if out_features is None else out_features
    recipe = load_recipe(recipe)

    def proj(fin, fout, init, kmeta, bmeta):
      n_in = len(fin) if isinstance(fin, tuple) else 1
      return QuantLinearGeneral(
          fin, fout, axis=tuple(range(-n_in, 0)), recipe=recipe,
          backend=backend, use_bias=use_bias,
          dtype=dtype, param_dtype=param_dtype, precision=precision,
          kernel_init=init, bias_init=bias_init, kernel_metadata=kmeta,
          bias_metadata=bmeta, rngs=rngs)

    qkv = (kernel_init, kernel_metadata, bias_metadata)
    if fused_qkv:
      self.query_key_value = proj(
          in_features, (num_heads + 2 * num_kv_heads, head_dim), *qkv)
      self.query = self.key = self.value = nnx.data(None)
    else:
      self.query_key_value = nnx.data(None)
      self.query = proj(in_features, (num_heads, head_dim), *qkv)
      self.key = proj(in_kv_features, (num_kv_heads, head_dim), *qkv)
      self.value = proj(in_kv_features, (num_kv_heads, head_dim), *qkv)
    if out_kernel_metadata is None:
      out_kernel_metadata = kernel_metadata
    self.out = proj((num_heads, head_dim), out_features,
                    out_kernel_init or kernel_init, out_kernel_metadata,
                    out_bias_metadata)

    self.in_features, self.in_kv_features = in_features, in_kv_features
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.head_dim, self.out_features = head_dim, out_features
    self.fused_qkv, self.use_bias = fused_qkv, use_bias
    self.dtype, self.param_dtype = dtype, param_dtype
    self.recipe, self.backend = recipe, backend

  def qkv(self, x: jax.Array, x_kv: jax.Array | None = None):
    """Projects ``x`` (and ``x_kv`` for cross-attention) to heads.

    Args:
      x: ``(..., in_features)``.
      x_kv: key/value input ``(..., in_kv_features)`` (separate projections
        only); default ``x``.

    Returns:
      ``(q, k, v)`` of shapes ``(..., H, D)``, ``(..., Hkv, D)``,
      ``(..., Hkv, D)``.
    """
    if self.fused_qkv:
      if x_kv is not None and x_kv is not x:
        raise ValueError("A fused QKV projection takes a single input; build "
                         "the layer with fused_qkv=False for cross-attention.")
      y = self.query_key_value(x)
      h, hkv = self.num_heads, self.num_kv_heads
      return y[..., :h, :], y[..., h:h + hkv, :], y[..., h + hkv:, :]
    x_kv = x if x_kv is None else x_kv
    return self.query(x), self.key(x_kv), self.value(x_kv)

  @staticmethod
  def attend(q: jax.Array, k: jax.Array, v: jax.Array,
             mask: jax.Array | None = None, *, bias: jax.Array | None = None,
             is_causal: bool = False) -> jax.Array:
    """Softmax attention, unquantized (``jax.nn.dot_product_attention``).

    What ``nnx.MultiHeadAttention`` computes without dropout: scores and
    softmax in FP32, grouped-query heads supported.

    Args:
      q: ``(..., T, H, D)``.
      k, v: ``(..., S, Hkv, D)``.
      mask: booleans broadcastable to ``(..., H, T, S)``; False is masked.
      bias: additive bias broadcastable to ``(..., H, T, S)``.
      is_causal: apply a causal mask.

    Returns:
      ``(..., T, H, D)``, ready for ``out``.
    """
    shape = q.shape
    if q.ndim > 4:
      lead = shape[:-3]

      def flat(t):
        return t.reshape(math.prod(lead), *t.shape[-3:])

      def flat_broadcast(t):  # a mask or bias over some of q's batch dims
        if t is None:
          return None
        t = t.reshape((1,) * (q.ndim - t.ndim) + t.shape)
        return flat(jnp.broadcast_to(t, lead + t.shape[-3:]))

      mask, bias = flat_broadcast(mask), flat_broadcast(bias)
      q, k, v = map(flat, (q, k, v))
    if mask is not None:
      mask = mask.astype(jnp.bool_)
    # jax.nn promotes narrow inputs to FP32 scores internally, which strict
    # dtype promotion refuses; the promotion is intended here.
    with jax.numpy_dtype_promotion("standard"):
      out = jax.nn.dot_product_attention(q, k, v, bias, mask,
                                         is_causal=is_causal)
    return out.reshape(shape[:-1] + (out.shape[-1],))

  @classmethod
  def from_multihead(cls, mha: nnx.MultiHeadAttention, *,
                     recipe: Recipe | str = "fp8_delayed",
                     backend: str | None = None) -> "QuantAttentionProj":
    """Quantized projections that share ``mha``'s query/key/value/out Params.

    The returned module holds the very Param Variables of ``mha`` (training
    one trains the other). Replace ``mha(x, mask=m)`` by
    ``p.out(p.attend(*p.qkv(x), m))``. QK normalization, dropout and the
    decode cache are not projections and are not supported here.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import qlayers
      >>> mha = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
      >>> p = qlayers.QuantAttentionProj.from_multihead(mha, recipe="bf16")
      >>> x = jnp.ones((2, 5, 32))
      >>> bool(jnp.allclose(p.out(p.attend(*p.qkv(x))), mha(x), atol=0.05))
      True
    """
    if mha.normalize_qk:
      raise ValueError("from_multihead does not support normalize_qk=True "
                       "(the QK LayerNorms sit between the projections).")
    if mha.dropout_rate:
      raise ValueError("from_multihead does not support attention dropout "
                       f"(dropout_rate={mha.dropout_rate}).")
    proj = cls(mha.in_features, mha.num_heads, mha.head_dim,
               num_kv_heads=mha.num_kv_heads,
               in_kv_features=mha.in_kv_features,
               out_features=mha.out_features, use_bias=mha.use_bias,
               dtype=mha.dtype, param_dtype=mha.param_dtype,
               precision=mha.precision, kernel_init=nnx.initializers.zeros,
               rngs=nnx.Rngs(0), recipe=recipe, backend=backend)
    for name in ("query", "key", "value", "out"):
      src, dst = getattr(mha, name), getattr(proj, name)
      dst.kernel = src.kernel
      if src.bias is not None:
        dst.bias = src.bias
      # Seeded from the zeros it was built with, every projection would
      # draw the same stochastic rounding bits.
      dst.quant.seed_from(dst.kernel[...])
    return proj

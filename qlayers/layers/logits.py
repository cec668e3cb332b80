"""QuantLogits: the output head (untied or tied to an ``nnx.Embed``) and a
chunked cross-entropy that never materialises the full logits."""

from __future__ import annotations

import math
import operator
from types import MappingProxyType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax import lax

from qlayers import ops
from qlayers import sharding
from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.layers.dense import check_last_dim
from qlayers.recipe import Recipe

__all__ = ["QuantLogits"]

_default_kernel_init = nnx.initializers.lecun_normal()


def _pick(logits, labels):
  """``logits[..., labels]``. With explicit mesh axes (the vocabulary may be
  split over devices) a masked sum over the vocabulary, which needs no
  output sharding spelled out; the same value, as every other term is 0."""
  if not sharding.explicit_axes():
    return jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  vocab = lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1,
                               out_sharding=jax.typeof(logits).sharding)
  return jnp.sum(jnp.where(vocab == labels[..., None], logits, 0.0), axis=-1)


class QuantLogits(QuantLayer, nnx.Module):
  """Output head producing FP32 logits, optionally quantized.

  Untied, it owns ``kernel (in_features, vocab_size)`` (and ``bias
  (vocab_size,)``) -- the Params of an ``nnx.Linear`` head. Tied
  (``embed=...``), it reuses the ``nnx.Embed`` table ``embedding (vocab, d)``
  transposed, so gradients of the logits flow into the embedding.

  The logits GEMM is not quantized by default (``recipe="bf16"``: BF16
  operands, FP32 accumulation and output): the vocabulary projection is
  sensitive to quantization, so quantizing it is opt-in with any recipe.
  `loss` computes the mean token cross-entropy over chunks of the sequence,
  recomputing each chunk's logits in the backward pass, so the
  ``(batch, seq, vocab)`` logits never exist at once.

  Args:
    in_features: model width ``d`` (taken from ``embed`` when tied).
    vocab_size: number of classes (taken from ``embed`` when tied).
    embed: an ``nnx.Embed`` whose table to tie to.
    use_bias: add a bias ``(vocab_size,)`` (a Param of this module).
    dtype: computation dtype of the GEMM operands (default: ``embed.dtype``
      when tied, else inferred from inputs and params).
    param_dtype: dtype of the kernel and bias.
    precision: accepted for ``nnx.Linear`` compatibility; the recipe sets
      the operand precision.
    kernel_init: initializer of the untied kernel.
    bias_init: initializer of the bias.
    kernel_metadata: metadata of the untied kernel (e.g. ``{"out_sharding":
      (None, "model")}``), as ``nnx.Linear`` takes it.
    bias_metadata: metadata of the bias.
    rngs: RNG streams (``params``); needed when this module creates Params.
    recipe: quantization recipe (default ``"bf16"``: not quantized).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> head = qlayers.QuantLogits(16, 100, rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(head, nnx.Param))
    State({
      'kernel': Param(
        value=(16, 100)
      )
    })
    >>> x = jnp.ones((2, 8, 16))
    >>> head(x).dtype
    dtype('float32')
    >>> labels = jnp.zeros((2, 8), jnp.int32)
    >>> bool(jnp.allclose(head.loss(x, labels, chunk_size=4),
    ...                   head.loss(x, labels)))
    True
    >>> embed = nnx.Embed(100, 16, rngs=nnx.Rngs(0))
    >>> tied = qlayers.QuantLogits(embed=embed)
    >>> tied(x).shape
    (2, 8, 100)
  """

  def __init__(self, in_features: int | None = None,
               vocab_size: int | None = None, *,
               embed: nnx.Embed | None = None, use_bias: bool = False,
               dtype=None, param_dtype=jnp.float32, precision=None,
               kernel_init=_default_kernel_init,
               bias_init=nnx.initializers.zeros_init(),
               kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
               bias_metadata: Mapping[str, Any] = MappingProxyType({}),
               rngs: nnx.Rngs | None = None,
               recipe: Recipe | str = "bf16", backend: str | None = None):
    if embed is not None and not isinstance(embed, nnx.Embed):
      raise TypeError(f"embed must be the nnx.Embed whose table the head "
                      f"ties to, got {type(embed).__name__}.")
    if embed is not None:
      vocab, d = embed.embedding.shape
      if in_features not in (None, d) or vocab_size not in (None, vocab):
        raise ValueError(
            f"The tied embedding is (vocab={vocab}, d={d}) but "
            f"in_features={in_features}, vocab_size={vocab_size} were given.")
      in_features, vocab_size = d, vocab
      dtype = embed.dtype if dtype is None else dtype
    elif in_features is None or vocab_size is None:
      raise ValueError("An untied QuantLogits needs in_features and "
                       "vocab_size (or pass embed=... to tie).")
    if (embed is None or use_bias) and rngs is None:
      raise ValueError("QuantLogits creates Params here and needs `rngs`.")

    if embed is None:
      self.kernel = nnx.Param(
          kernel_init(rngs.params(), (in_features, vocab_size), param_dtype),
          **kernel_metadata)
    else:
      self.kernel = nnx.data(None)
    self.embed = embed if embed is not None else nnx.data(None)
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (vocab_size,),
                                      param_dtype), **bias_metadata)
    else:
      self.bias = nnx.data(None)

    self.in_features = in_features
    self.vocab_size = vocab_size
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.quant = QuantGemm(recipe, backend=backend)
    self.quant.seed_from(self._weights()[0])

  @property
  def tied(self) -> bool:
    return self.embed is not None

  def _weights(self):
    """(kernel ``(d, vocab)``, bias or None, delayed state or None)."""
    if self.embed is not None:
      kernel = self.embed.embedding[...].T
    else:
      kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    return kernel, bias, self.quant.read()

  def _logits(self, x, kernel, bias, state, key=None):
    """Pure: FP32 logits ``(..., vocab)`` and the op's new state."""
    x, _, bias = dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
    y, new_state = ops.quantized_matmul(x, kernel, self.recipe, state,
                                        key=key, out_dtype=jnp.float32,
                                        backend=self.backend)
    if bias is not None:
      y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
    return y, new_state

  def _check(self, x):
    table = self.embed.embedding if self.tied else self.kernel
    d = table.shape[1] if self.tied else table.shape[0]  # the local kernel's
    check_last_dim("QuantLogits", x, d)

  def __call__(self, x: jax.Array) -> jax.Array:
    """FP32 logits ``(..., vocab_size)`` of ``x (..., in_features)``."""
    self._check(x)
    kernel, bias, state = self._weights()
    with self.quant.writing_state("matmul (of a QuantLogits)"):
      y, new_state = self._logits(x, kernel, bias, state,
                                  self.quant.rounding_key())
      self.quant.write(new_state)
    return y

  def loss(self, x: jax.Array, labels: jax.Array, *,
           chunk_size: int | None = None,
           mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy of the logits of ``x`` against ``labels``.

    With ``chunk_size``, the sequence is processed ``chunk_size`` positions
    at a time (logits, logsumexp, picked logit), each chunk rematerialised
    in the backward pass: peak memory holds one ``(batch, chunk, vocab)``
    block instead of ``(batch, seq, vocab)``. With a wide recipe the value
    and gradients equal the unchunked ones up to float summation order; a
    quantizing recipe scales each chunk's operands by their own amax (per
    tensor: the chunk's), so they differ by that rounding too (about 1e-4
    relative for ``fp8_current``). A sequence that is not a multiple
    of ``chunk_size`` is padded with masked positions.

    Args:
      x: hidden states ``(..., seq, in_features)``.
      labels: integer classes in ``[0, vocab_size)``, shape ``(..., seq)``;
        at masked positions any value (padding), elsewhere one outside makes
        the loss NaN.
      chunk_size: positions per chunk (``None``: the whole sequence at once).
      mask: booleans ``(..., seq)``; False positions are left out of the
        mean.

    Returns:
      The FP32 scalar ``sum(mask * ce) / max(sum(mask), 1)``.
    """
    self._check(x)
    if x.ndim < 2 or labels.shape != x.shape[:-1]:
      raise ValueError(f"Expected x (..., seq, d) and labels (..., seq); got "
                       f"{x.shape} and {labels.shape}.")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
      raise TypeError(f"labels must be integers, got {labels.dtype}.")
    if mask is None:
      mask = jnp.ones(labels.shape, jnp.float32)
    elif mask.shape != labels.shape:
      raise ValueError(f"mask shape {mask.shape} != labels shape "
                       f"{labels.shape}.")
    mask = mask.astype(jnp.float32)
    if chunk_size is not None:
      try:
        chunk_size = operator.index(chunk_size)
      except TypeError:
        raise TypeError(f"chunk_size must be an int or None, got "
                        f"{chunk_size!r}.") from None
      if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")

    kernel, bias, state = self._weights()
    with self.quant.writing_state("matmul (of a QuantLogits)"):
      key = self.quant.rounding_key()  # None unless sr_key = "step"
    seq = x.shape[-2]
    batch = math.prod(x.shape[:-2])
    x = x.reshape(batch, seq, x.shape[-1])
    labels = labels.reshape(batch, seq)
    mask = mask.reshape(batch, seq)

    # Each chunk is a use of the state: the gradient amax is carried from
    # chunk to chunk (a chain, so the backward pass combines it by max; see
    # `QuantGemm.write`).
    def chunk(g_amax, args):
      xc, yc, mc, kc = args
      if state is not None:
        st = {**state, "g": state["g"]._replace(amax=g_amax)}
      logits, new_state = self._logits(xc, kernel, bias,
                                       None if state is None else st, kc)
      lse = jax.nn.logsumexp(logits, axis=-1)
      # A masked position adds 0 whatever its label (padding may hold any);
      # an unmasked label outside [0, vocab) makes the loss NaN (a negative
      # one would otherwise pick from the end).
      keep = mc > 0
      valid = (yc >= 0) & (yc < logits.shape[-1])
      picked = jnp.where(valid, _pick(logits, jnp.where(keep & valid, yc, 0)),
                         jnp.nan)
      total = jnp.sum(jnp.where(keep, (lse - picked) * mc, 0.0))
      if new_state is None:
        return g_amax, (total, ())
      return new_state["g"].amax, (total, (new_state["x"].amax,
                                           new_state["w"].amax))

    g_amax = None if state is None else state["g"].amax
    if chunk_size is None or chunk_size >= seq:
      g_amax, (total, amaxes) = chunk(g_amax, (x, labels, mask, key))
    else:
      n = -(-seq // chunk_size)
      pad = n * chunk_size - seq
      if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))

      def split(t):  # (batch, n * c, ...) -> (n, batch, c, ...)
        t = t.reshape(batch, n, chunk_size, *t.shape[2:])
        return jnp.moveaxis(t, 1, 0)

      keys = None if key is None else jax.random.split(key, n)
      g_amax, (totals, amaxes) = lax.scan(
          jax.checkpoint(chunk, prevent_cse=False), g_amax,
          (split(x), split(labels), split(mask), keys))
      total = jnp.sum(totals)
      amaxes = tuple(jnp.max(a, axis=0) for a in amaxes)
    if state is not None:
      ax, aw = amaxes
      with self.quant.writing_state("matmul (of a QuantLogits)"):
        self.quant.write({"x": state["x"]._replace(amax=ax),
                          "w": state["w"]._replace(amax=aw),
                          "g": state["g"]._replace(amax=g_amax)})
    return total / jnp.maximum(jnp.sum(mask), 1.0)

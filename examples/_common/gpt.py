"""A small GPT for training from scratch, built from stock ``flax.nnx`` layers.

Pre-norm transformer: RMSNorm, causal self-attention with rotary positions
(fused QKV projection), GELU MLP, untied output head. Every matrix multiply
with a weight is an ``nnx.Linear`` attribute, so ``qlayers.quantize`` can
swap them all; attention scores, softmax and norms stay plain JAX.

Example::

  config = GPTConfig(vocab_size=256, max_len=128, d_model=128, n_layers=2,
                     n_heads=4, d_ff=512)
  model = GPT(config, rngs=nnx.Rngs(0))
  logits = model(jnp.zeros((2, 16), jnp.int32))      # f32 [2, 16, 256]
  print(jax.tree.map(jnp.shape, nnx.state(model, nnx.Param)))
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import attention, causal_mask, rope
from .lm import generate, perplexity

__all__ = [
    "GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP",
    "generate", "perplexity",
]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Hyperparameters of :class:`GPT`.

  Attributes:
    vocab_size: number of token ids (256 for ``ByteTokenizer``).
    max_len: longest sequence trained on; ``generate`` windows to it.
    d_model: width of the residual stream.
    n_layers: transformer blocks.
    n_heads: attention heads; ``d_model`` must divide by it.
    d_ff: MLP hidden width.
    rope_theta: rotary position base.
    norm_eps: RMSNorm epsilon.
    dtype: computation dtype of the ``nnx.Linear`` layers (e.g.
      ``jnp.bfloat16``); parameters, norms and the residual stream stay
      float32, and logits are returned as float32. ``None``: float32.
  """

  vocab_size: int = 256
  max_len: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 1024
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: Any = None

  def __post_init__(self):
    if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
      raise ValueError(
          f"d_model={self.d_model} must split into n_heads={self.n_heads}"
          " heads of even size"
      )


def _dense(config, d_in, d_out, *, std, rngs):
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=config.dtype,
      kernel_init=nnx.initializers.normal(std), rngs=rngs,
  )


def _norm(config, *, rngs):
  # Norms run on the float32 residual stream (flax norms reject bf16 inputs
  # under strict dtype promotion); the next nnx.Linear casts to config.dtype.
  return nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal attention: ``qkv`` and ``out`` are ``nnx.Linear``."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    d = config.d_model
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    self.qkv = _dense(config, d, 3 * d, std=0.02, rngs=rngs)
    self.out = _dense(config, d, d, std=residual_std, rngs=rngs)
    self.n_heads = config.n_heads
    self.rope_theta = config.rope_theta

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[B, T, d_model] -> [B, T, d_model]``."""
    b, t, d = x.shape
    qkv = self.qkv(x).reshape(b, t, 3, self.n_heads, d // self.n_heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k = rope(q, theta=self.rope_theta), rope(k, theta=self.rope_theta)
    y = attention(q, k, v, mask=causal_mask(t))
    return self.out(y.reshape(b, t, d))


class MLP(nnx.Module):
  """``down(gelu(up(x)))`` with ``nnx.Linear`` layers."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    self.up = _dense(config, config.d_model, config.d_ff, std=0.02, rngs=rngs)
    self.down = _dense(
        config, config.d_ff, config.d_model, std=residual_std, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

  The residual stream ``x`` stays float32 whatever ``config.dtype`` is.
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.attn_norm = _norm(config, rngs=rngs)
    self.attn = CausalSelfAttention(config, rngs=rngs)
    self.mlp_norm = _norm(config, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
    return x + self.mlp(self.mlp_norm(x)).astype(x.dtype)


class GPT(nnx.Module):
  """Decoder-only transformer LM.

  Args:
    config: a :class:`GPTConfig`.
    rngs: random streams for parameter init.
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(
        config.vocab_size, config.d_model,
        embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
    )
    self.blocks = nnx.List(
        [Block(config, rngs=rngs) for _ in range(config.n_layers)]
    )
    self.final_norm = _norm(config, rngs=rngs)
    self.head = _dense(config, config.d_model, config.vocab_size, std=0.02, rngs=rngs)
    self.config = config

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int ``[B, T]`` token ids -> float32 ``[B, T, vocab_size]`` logits."""
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.final_norm(x)).astype(jnp.float32)

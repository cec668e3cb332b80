"""Plain-JAX attention pieces shared by the example models.

Projections are ``nnx.Linear`` layers in the models themselves; what is here
has no parameters: rotary position embedding, masks and softmax attention.
Shapes: ``B`` batch, ``T`` query length, ``S`` key length, ``H`` query heads,
``K`` key/value heads (``H`` a multiple of ``K``), ``D`` head size.
"""

import jax
import jax.numpy as jnp

# Large negative logit for masked keys; finite so fully masked rows stay NaN-free.
_MASKED = -1e30


def rope(x: jax.Array, *, theta: float) -> jax.Array:
  """Rotary position embedding, positions ``0 .. T-1``.

  Uses the "rotate half" pairing (dimension ``i`` with ``i + D/2``) of
  GPT-NeoX and Hugging Face LLaMA. Computed in float32; returns ``x.dtype``.

  Args:
    x: ``[B, T, H, D]`` queries or keys, ``D`` even.
    theta: the RoPE base (10000 in the original paper).
  """
  _, t, _, d = x.shape
  inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def causal_mask(t: int) -> jax.Array:
  """``[1, 1, T, T]`` bool, True where query ``i`` may see key ``j <= i``."""
  return jnp.tril(jnp.ones((t, t), jnp.bool_))[None, None]


def padding_mask(attention_mask: jax.Array) -> jax.Array:
  """``[B, 1, 1, S]`` bool from a ``[B, S]`` 0/1 mask of real tokens."""
  return (attention_mask != 0)[:, None, None, :]


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array
) -> jax.Array:
  """Scaled dot-product attention with grouped key/value heads.

  Query head ``h`` reads key/value head ``h // (H // K)`` (as Hugging Face's
  ``repeat_kv``). Scores and softmax are float32; the output has ``v.dtype``.

  Args:
    q: ``[B, T, H, D]``.
    k: ``[B, S, K, D]``.
    v: ``[B, S, K, D]``.
    mask: bool, broadcastable to ``[B, 1, T, S]``; True where attention is
      allowed.

  Returns:
    ``[B, T, H, D]``.
  """
  b, t, h, d = q.shape
  kv = k.shape[2]
  if h % kv:
    raise ValueError(f"{h} query heads do not divide into {kv} kv heads")
  q = q.reshape(b, t, kv, h // kv, d) * (d**-0.5)
  scores = jnp.einsum(
      "btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32
  )
  scores = jnp.where(mask[:, :, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d)

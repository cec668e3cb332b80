"""Rematerialization policies that keep the quantized GEMM inputs.

A quantized linear saves, for its weight gradient, the copy of its input
quantized along the token axis (payload + scales, named
``qlayers.ops.WGRAD_INPUT_NAME``) instead of the wide input. Under
``jax.checkpoint`` / ``nnx.remat`` the policy below saves exactly these
copies (plus any names you add) and recomputes everything else of the
forward pass in the backward pass: norms, attention, activations and the
wide GEMM inputs. Saved activations are then the low-precision GEMM inputs
plus the inputs of the checkpointed function.
"""

from __future__ import annotations

import jax

from qlayers.ops import WGRAD_INPUT_NAME

__all__ = ["remat_policy", "WGRAD_INPUT_NAME"]


def remat_policy(*extra_names: str):
  """A ``jax.checkpoint`` policy saving only quantized Wgrad inputs (+ names).

  Args:
    *extra_names: further ``jax.ad_checkpoint.checkpoint_name`` names to
      save, e.g. a block input or an attention output you tag yourself.

  Returns:
    ``jax.checkpoint_policies.save_only_these_names(WGRAD_INPUT_NAME,
    *extra_names)``, for ``jax.checkpoint(..., policy=...)`` or
    ``nnx.remat(..., policy=...)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import qlayers
    >>> def mlp(w1, w2, x):
    ...   h, _ = qlayers.ops.quantized_matmul(x, w1, "fp8_current")
    ...   y, _ = qlayers.ops.quantized_matmul(jax.nn.gelu(h), w2, "fp8_current")
    ...   return jnp.sum(y ** 2)
    >>> f = jax.checkpoint(mlp, policy=qlayers.remat_policy())
    >>> w1, w2, x = jnp.ones((64, 128)), jnp.ones((128, 64)), jnp.ones((8, 64))
    >>> _, vjp = jax.vjp(f, w1, w2, x)
    >>> sorted({str(r.dtype) for r in jax.tree.leaves(vjp) if r.size > 64})
    ['float32', 'float8_e4m3fn']
    >>> [r.shape for r in jax.tree.leaves(vjp) if r.dtype == jnp.float8_e4m3fn]
    [(8, 64), (8, 128)]

    The FP32 leaves are the inputs ``w1``, ``w2``, ``x``; the GELU input and
    output are recomputed, and each GEMM input is kept as its FP8 copy.
  """
  for n in extra_names:
    if not isinstance(n, str):
      raise TypeError(f"remat_policy takes checkpoint names (str), got "
                      f"{type(n).__name__}: {n!r}.")
  return jax.checkpoint_policies.save_only_these_names(WGRAD_INPUT_NAME,
                                                       *extra_names)

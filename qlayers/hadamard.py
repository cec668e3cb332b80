"""Random Hadamard transform (RHT) along a GEMM's contraction dimension.

For an orthonormal ``Q``, ``(Q a)^T (Q b) = a^T b``: transforming both
operands of a GEMM along the dimension it contracts leaves the product
unchanged in exact arithmetic, while it spreads each outlier over the
transform block, so block scales (MX: 32 elements share one power-of-two
scale) fit the values better and 4-bit elements lose less. FP4 training
recipes apply it to the Wgrad operands, whose contraction runs over the
tokens: Tseng et al., "Training LLMs with MXFP4" (2025), and NVIDIA's
"Pretraining Large Language Models with NVFP4" (2025), which applies a
16x16 Hadamard matrix with a random sign vector to the Wgrad inputs only.

Here ``Q`` is block diagonal: every ``size`` consecutive rows along the axis
get ``H_size @ diag(signs)``, with ``H_size`` the normalised Sylvester
Hadamard matrix and ``signs`` a fixed pseudo-random +-1 vector (the same for
both operands, or the product would change). A length that is not a
multiple of ``size`` is zero-padded first; zero rows add nothing to the
product. ``Q t`` is computed as a fast Walsh-Hadamard `butterfly` in FP32
(exact sign flips, one fixed chain of additions per element, then the
``1 / sqrt(size)`` factor), so a GPU kernel that fuses the transform into a
quantize reproduces it bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["SIZES", "hadamard_matrix", "random_signs", "transform",
           "butterfly"]

SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
"""Block sizes `transform` accepts (powers of two)."""

_SIGN_SEED = 0x5EED  # fixed: the transform must not change between calls


def _check_size(size: int) -> None:
  if size not in SIZES:
    raise ValueError(f"Hadamard block size must be one of {SIZES}, got "
                     f"{size!r}.")


@functools.cache
def hadamard_matrix(size: int) -> np.ndarray:
  """The ``size x size`` Sylvester Hadamard matrix over ``sqrt(size)``
  (orthonormal, symmetric), float32.

  Example:
    >>> h = hadamard_matrix(4)
    >>> bool(np.allclose(h @ h.T, np.eye(4))), np.sign(h[1]).tolist()
    (True, [1.0, -1.0, 1.0, -1.0])
  """
  _check_size(size)
  h = np.ones((1, 1))
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  return (h / np.sqrt(size)).astype(np.float32)


@functools.cache
def random_signs(size: int) -> np.ndarray:
  """The fixed +-1 float32 vector of the transform of this block size.

  Example:
    >>> bool(np.all(np.abs(random_signs(16)) == 1))
    True
  """
  _check_size(size)
  rng = np.random.default_rng(_SIGN_SEED + size)
  return rng.choice(np.array([-1.0, 1.0], np.float32), size)


def transform(t: jax.Array, size: int, axis: int = 0) -> jax.Array:
  """``Q t`` along ``axis`` of a 2-D ``t``, in float32, zero-padded there to
  a multiple of ``size``.

  Example:
    >>> import jax.numpy as jnp
    >>> from qlayers import hadamard
    >>> a, b = jnp.ones((64, 3)), jnp.arange(128.0).reshape(64, 2)
    >>> qa, qb = hadamard.transform(a, 32), hadamard.transform(b, 32)
    >>> bool(jnp.allclose(qa.T @ qb, a.T @ b, rtol=1e-5))
    True
  """
  _check_size(size)
  if t.ndim != 2 or axis not in (0, 1):
    raise ValueError(f"transform takes a 2-D array and axis 0 or 1, got "
                     f"shape {t.shape} and axis {axis}.")
  if axis == 1:
    return transform(t.T, size, 0).T
  m, k = t.shape
  padded = -(-m // size) * size
  t = t.astype(jnp.float32)
  if padded != m:
    t = jnp.pad(t, ((0, padded - m), (0, 0)))
  y = t.reshape(padded // size, size, k) * random_signs(size)[None, :, None]
  y = butterfly(y, axis=1)
  return (y * norm(size)).reshape(padded, k)


def norm(size: int) -> np.float32:
  """``1 / sqrt(size)`` in FP32 (a power of two, so exact, for 4, 16, 64,
  256)."""
  return np.float32(1.0 / np.sqrt(size))


def butterfly(y: jax.Array, axis: int) -> jax.Array:
  """The unnormalised Walsh-Hadamard transform of ``y`` along ``axis``
  (length a power of two): ``log2(n)`` stages, the first pairing elements
  ``n / 2`` apart, each writing ``a + b`` to the first of a pair and ``a -
  b`` to the second. Every element is one fixed chain of FP32 additions, so
  a kernel that runs the same stages (`qlayers.cast_transpose`) gets the
  same bits; an FP32 matrix product would sum in whatever order its backend
  picks.

  Example:
    >>> import jax.numpy as jnp
    >>> butterfly(jnp.array([1.0, 2.0, 3.0, 4.0]), axis=0).tolist()
    [10.0, -2.0, -4.0, 0.0]
  """
  axis = axis % y.ndim
  n = y.shape[axis]
  before, after = y.shape[:axis], y.shape[axis + 1:]
  h = n // 2
  while h:
    pairs = y.reshape(*before, n // (2 * h), 2, h, *after)
    a, b = (lax.index_in_dim(pairs, i, axis + 1, keepdims=False)
            for i in (0, 1))
    y = jnp.stack([a + b, a - b], axis=axis + 1).reshape(y.shape)
    h //= 2
  return y

"""Shared helpers of the cast-kernel tests (tests/test_cast_transpose_*.py):
bit patterns, sample data with every special value, and a recipe's matmul
run paired for a GPU target in Pallas' interpreter."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

import qlayers
from qlayers import cast_transpose as ct
from qlayers import hadamard
from qlayers import ops
from qlayers import table


def bits(a):
  """Bit patterns, every NaN as one (E5M2 has several NaN codes; an Inf
  times zero is -NaN on x86 and +NaN on GPUs)."""
  a = np.asarray(a)
  u = a.view(np.dtype(f"u{a.dtype.itemsize}"))
  return np.where(np.isnan(a.astype(np.float32)), np.iinfo(u.dtype).max, u)


# Jitted: one compile per shape, where eager calls compile each of the
# butterfly's stages (a few ops each) one by one.
transform = jax.jit(hadamard.transform, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(0, 1))  # one compile, not seven
def data(shape, dtype):
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 300.0
  # NaN, +-Inf, overflow past the format's max, values rounding to zero and
  # to subnormals, ties of the multiplier.
  x = x.at[0, 0].set(jnp.nan).at[1, 3].set(jnp.inf).at[2, 5].set(-jnp.inf)
  x = x.at[3, 7].set(-1e30).at[4, 9].set(1e-12).at[5, 11].set(3e-4)
  return x.astype(dtype)


def spec(name="fp8_current"):
  return qlayers.recipe(name).fprop.lhs


def paired_against_unpaired(monkeypatch, recipe, arch, kernel, record):
  """(unpaired, paired) value and gradients of a ``recipe`` matmul, the
  paired one traced for ``arch`` with every pair's CUDA branch taken and
  ``cast_transpose.<kernel>`` run in Pallas' interpreter on CPU;
  ``record(t, args, kw)`` sees each of its calls."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1

  def loss(x, w):
    y, _ = ops.quantized_matmul(x, w, recipe)
    return jnp.sum(y * jnp.cos(y))

  # Jitted: one compile each, where eager calls compile every op one by
  # one. The kernels' calls are recorded as the paired one is traced.
  grad = jax.value_and_grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(x, w)
  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  original = getattr(ct, kernel)

  def interpreted(t, *args, **kw):
    record(t, args, kw)
    return original(t, *args, interpret=True, **kw)

  monkeypatch.setattr(qlayers.operands.cast_transpose, kernel, interpreted)
  with table.target_arch(arch):
    got = jax.jit(grad)(x, w)
  return want, got

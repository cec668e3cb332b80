"""The Hadamard transform kernel (qlayers/cast_transpose/hadamard.py) and the
recipes that run it."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
from qlayers import cast_transpose as ct
from qlayers import ops
from qlayers import table
from _support import cast_kernels as ck


@pytest.mark.parametrize("size,axis,shape", [
    (16, 0, (512, 48)), (32, 0, (64, 32)), (256, 0, (256, 16)),
    (32, 1, (24, 96)), (128, 1, (8, 256))])
def test_transform_kernel_is_the_hadamard_transform_bit_for_bit(size, axis,
                                                                 shape):
  t = (jax.random.normal(jax.random.key(size), shape) * 3).astype(
      jnp.bfloat16)
  t = t.at[1, 1].set(jnp.inf)  # its block's outputs Inf or NaN, as XLA's
  got = ct.transform(t, size, axis, interpret=True)
  want = ck.transform(t, size, axis)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="multiple of"):
    ct.transform(t[:, :-1] if axis else t[:-1], size, axis, interpret=True)


def test_hadamard_recipe_runs_the_transform_kernel_with_its_bits(
    monkeypatch):
  """mxfp4_mlperf (Dgrad and Wgrad transformed) traced for Blackwell:
  each transformed operand is the one-pass kernel's (in the CUDA
  lowering), and with the kernels interpreted on CPU the output and
  gradients keep the bits of the CPU program."""
  # Dims that are multiples of 16, not 32: no MXFP4 pair kernel, so each
  # transformed operand is quantized in XLA's passes, from the kernel's.
  x = jax.random.normal(jax.random.key(1), (2, 24, 48), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (48, 80), jnp.float32) * 0.1
  recipe = qlayers.recipe("mxfp4_mlperf")
  state = ops.init_state(recipe)

  def loss(x, w, state):
    y, _ = ops.quantized_matmul(x, w, recipe, state)
    return jnp.sum(y * jnp.cos(y))

  grad = jax.value_and_grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(x, w, state)  # one compile, not one per op
  with table.target_arch("sm_100"):
    text = jax.jit(grad).trace(x, w, state).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "qlayers_hadamard_transform" in text
  monkeypatch.setattr(qlayers.operands, "lax", types.SimpleNamespace(
      **{**vars(jax.lax), "platform_dependent":
         lambda *args, cuda, **_: cuda(*args)}))
  calls, kernel = [], ct.transform

  def interpreted(t, size, axis):
    calls.append((size, axis))
    return kernel(t, size, axis, interpret=True)

  monkeypatch.setattr(qlayers.operands.cast_transpose, "transform",
                      interpreted)
  jax.clear_caches()  # the GEMMs' cached traces: traced anew, patched
  with table.target_arch("sm_100"):
    got = jax.jit(lambda *a: grad(*a))(x, w, state)
  assert sorted(calls) == [(16, 0), (16, 0), (16, 1), (16, 1)]  # x, g; g, w
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

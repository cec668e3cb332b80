"""QuantDense as a drop-in nnx.Linear."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import ops
from qlayers import scaling as S
from helpers import (DEFAULT_FLOOR, DENSE_FLOORS, delayed, optax_rules, pure,
                     param_signature, train_step, weighted_sum)
from numerics import sqnr_db


def bf16_dot(lhs, rhs, dims, precision=None, preferred_element_type=None,
             out_sharding=None):
  """The "bf16" recipe's GEMM: BF16 operands, FP32 accumulation, as 2-D."""
  del precision, out_sharding
  out = jax.lax.dot_general(
      lhs.reshape(-1, lhs.shape[-1]).astype(jnp.bfloat16),
      rhs.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32)
  out = out.reshape(*lhs.shape[:-1], rhs.shape[-1])
  return out.astype(preferred_element_type or lhs.dtype)


DTYPE_COMBOS = [  # (dtype, param_dtype, input dtype)
    (None, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (None, jnp.bfloat16, jnp.bfloat16),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
]


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("dtype,param_dtype,x_dtype", DTYPE_COMBOS)
def test_dense_bf16_is_linear(dtype, param_dtype, x_dtype, use_bias):
  """Under "bf16" QuantDense is nnx.Linear with BF16 GEMM operands and FP32
  accumulation (whatever dtype the Params and inputs have)."""
  kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype)
  lin = nnx.Linear(24, 8, rngs=nnx.Rngs(0), dot_general=bf16_dot, **kw)
  qd = qlayers.QuantDense(24, 8, rngs=nnx.Rngs(1), recipe="bf16", **kw)
  assert param_signature(qd) == param_signature(lin)
  # Linear -> QuantDense -> Linear, with values neither layer started from.
  new = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(7), p.shape, p.dtype),
      nnx.state(lin, nnx.Param))
  nnx.update(lin, new)
  nnx.update(qd, nnx.state(lin, nnx.Param))
  back = nnx.Linear(24, 8, rngs=nnx.Rngs(2), dot_general=bf16_dot, **kw)
  nnx.update(back, nnx.state(qd, nnx.Param))
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(nnx.state(back))):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  x = jax.random.normal(jax.random.key(1), (3, 5, 24), x_dtype)
  y, ref = qd(x), lin(x)
  assert y.dtype == ref.dtype
  assert np.array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))


def test_dense_quantized_state_loads_from_linear():
  lin = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
  qd = qlayers.QuantDense(32, 16, rngs=nnx.Rngs(1), recipe=delayed())
  assert param_signature(qd) == param_signature(lin)
  nnx.update(qd, nnx.state(lin, nnx.Param))
  assert np.array_equal(qd.kernel[...], lin.kernel[...])
  # Quantization state is separate from the Params and never a Param.
  qstate = pure(nnx.state(qd, qlayers.QuantVariable))
  assert set(qstate) and all(k.startswith("quant/") for k in qstate)
  assert not any(k.startswith("quant") for k in pure(nnx.state(qd,
                                                                  nnx.Param)))


@pytest.mark.parametrize("name", qlayers.available_recipes())
def test_dense_sqnr_per_recipe(name):
  r = qlayers.recipe(name)
  lin = nnx.Linear(128, 64, rngs=nnx.Rngs(0))
  qd = qlayers.QuantDense(128, 64, rngs=nnx.Rngs(0), recipe=r)
  x = jax.random.normal(jax.random.key(3), (32, 128))
  y, ref = nnx.jit(lambda m, x: m(x))(qd, x), lin(x)
  assert y.shape == ref.shape and y.dtype == ref.dtype
  if not r.quantized:  # BF16/FP16 operands, FP32 accumulation
    assert 40 < sqnr_db(ref, y) < 120
  else:
    assert sqnr_db(ref, y) >= DENSE_FLOORS.get(name, DEFAULT_FLOOR)


@pytest.mark.parametrize("name", ["fp8_delayed", "fp8_current", "mxfp8"])
def test_dense_rejects_wrong_last_dim(name):
  qd = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=name)
  with pytest.raises(ValueError, match="last dim 16"):
    qd(jnp.ones((2, 12)))


def test_dense_unquantized_rejects_wrong_last_dim():
  qd = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe="bf16")
  with pytest.raises((TypeError, ValueError)):
    qd(jnp.ones((2, 12)))

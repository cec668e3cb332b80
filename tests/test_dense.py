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
from _support.helpers import (
    DEFAULT_FLOOR, DENSE_FLOORS, delayed, optax_rules, pure, param_signature,
    train_step, weighted_sum)
from _support.numerics import sqnr_db


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


def test_dense_rank0_input_is_the_type_error_linear_gives():
  """nnx.Linear raises TypeError (from lax.dot_general) for a scalar; so
  does QuantDense, naming itself and the shape it expects (it raised a bare
  IndexError)."""
  x = jnp.float32(1.0)
  with pytest.raises(TypeError):
    nnx.Linear(16, 8, rngs=nnx.Rngs(0))(x)
  for recipe in ("fp8_current", "bf16"):
    qd = qlayers.QuantDense(16, 8, rngs=nnx.Rngs(0), recipe=recipe)
    with pytest.raises(TypeError, match=r"QuantDense expects inputs of shape "
                       r"\(\.\.\., 16\), got a scalar"):
      qd(x)


def test_complex_inputs_are_refused_naming_the_layer():
  # nnx.Linear computes them; the quantized layers said only "x must be
  # floating point" from deep in the GEMM.
  x = jnp.ones((2, 8), jnp.complex64)
  experts = qlayers.layers.QuantExperts(2, 8, 4, rngs=nnx.Rngs(0))
  for layer, call in (
      (qlayers.QuantDense(8, 4, rngs=nnx.Rngs(0)), lambda l: l(x)),
      (qlayers.QuantLinearGeneral(8, 4, rngs=nnx.Rngs(0)), lambda l: l(x)),
      (qlayers.QuantEinsum("bd,df->bf", (8, 4), rngs=nnx.Rngs(0)),
       lambda l: l(x)),
      (experts, lambda l: l(x, jnp.array([1, 1], jnp.int32)))):
    with pytest.raises(TypeError, match=rf"{type(layer).__name__} expects "
                       r"real inputs, got complex64 of shape \(2, 8\)"):
      call(layer)


# A row-parallel layer inside jax.shard_map: kernel split along K over "tp",
# input split along its last dim, partial products summed with psum. Run in
# a subprocess with 4 CPU devices (JAX fixes the device count at start).
ROW_PARALLEL = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx
import qlayers

def row_parallel(layer, x, mesh):
  graphdef, state = nnx.split(layer)
  specs = jax.tree.map(lambda a: P("tp", None) if a.ndim == 2 else P(), state)
  place = lambda a, p: jax.device_put(a, NamedSharding(mesh, p))
  def loss(state, x):
    @jax.shard_map(mesh=mesh, in_specs=(specs, P(None, "tp")), out_specs=P())
    def f(state, x):
      return jax.lax.psum(nnx.merge(graphdef, state)(x), "tp")
    y = f(state, x)
    return jnp.sum(y * y), y
  (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      jax.tree.map(place, state, specs), place(x, P(None, "tp")))
  return y, g["kernel"][...]

def one_device(layer, x):
  def loss(layer, x):
    y = layer(x)
    return jnp.sum(y * y), y
  (_, y), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
  return y, g["kernel"][...]

mesh = jax.make_mesh((4,), ("tp",))
x = jax.random.normal(jax.random.key(0), (8, 256))
out = {}
for kind in ("Linear", "QuantDense"):
  kw = dict(use_bias=False, rngs=nnx.Rngs(0))
  layer = (nnx.Linear(256, 32, **kw) if kind == "Linear" else
           qlayers.QuantDense(256, 32, recipe="fp8_current", **kw))
  out[kind] = {k: np.asarray(v).tolist() for k, v in zip(
      ("y_tp", "g_tp", "y", "g"), row_parallel(layer, x, mesh)
      + one_device(layer, x))}
out["x"] = np.asarray(x).tolist()
out["w"] = np.asarray(layer.kernel[...]).tolist()
with open(sys.argv[1], "w") as f:
  json.dump(out, f)
'''


def test_dense_row_parallel_inside_shard_map(tmp_path):
  """The shape check reads the local kernel (K/4 rows per device), as
  nnx.Linear does; it compared the input with the global in_features.

  Scales are global inside shard_map (the amax is reduced with pmax over
  the axes the operand varies on), so each device quantizes its shard to
  the payloads the one-device layer makes: the outputs differ only by the
  order of the FP32 sum over K (bounded by K * eps * |x| @ |w|), far below
  the quantization error, and the kernel gradients likewise.
  """
  import subprocess, sys, json
  from _support import multidevice
  script = tmp_path / "row_parallel.py"
  script.write_text(ROW_PARALLEL)
  out = tmp_path / "out.json"
  proc = subprocess.run([sys.executable, str(script), str(out)],
                        env=multidevice.env(4), capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  r = {k: v if k in ("Linear", "QuantDense") else np.asarray(v, np.float64)
       for k, v in json.loads(out.read_text()).items()}
  q = {k: np.asarray(v) for k, v in r["QuantDense"].items()}
  stock = {k: np.asarray(v) for k, v in r["Linear"].items()}
  eps = float(np.finfo(np.float32).eps)
  bound = 256 * eps * (np.abs(r["x"]) @ np.abs(r["w"]))
  assert np.all(np.abs(q["y_tp"] - q["y"]) <= bound)
  assert np.all(np.abs(stock["y_tp"] - stock["y"]) <= bound)
  quant_error = np.abs(q["y"] - stock["y"]).max()
  assert np.abs(q["y_tp"] - q["y"]).max() < 1e-4 * quant_error
  np.testing.assert_allclose(q["g_tp"], q["g"], rtol=0,
                             atol=1e-6 * np.abs(q["g"]).max())


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_an_ensemble_stacked_by_vmap_differentiates(recipe):
  # Layers stacked by nnx.vmap and applied by nnx.vmap to one input: the
  # weight gradient's BF16 dot failed at run time on CPU ("Unsupported
  # element type for DotThunk::Execute: BF16 x BF16 = F32").
  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def stack(rngs):
    return qlayers.QuantDense(32, 32, recipe=recipe, rngs=rngs)

  layers = stack(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, 32))
  apply = nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))
  _, grads = qlayers.value_and_grad(
      lambda m, x: jnp.sum(apply(m, x).astype(jnp.float32) ** 2))(layers, x)
  dw = grads["kernel"][...]
  # Against the wide gradient, 2 x^T (x W + b) per layer.
  y = jnp.einsum("mk,lkn->lmn", x, layers.kernel[...]) + layers.bias[...][
      :, None]
  want = jnp.einsum("mk,lmn->lkn", x, 2 * y)
  assert float(jnp.linalg.norm(dw - want) / jnp.linalg.norm(want)) < (
      0.01 if recipe == "bf16" else 0.06)

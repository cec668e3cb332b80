"""The native per-tensor FP8 quantize (qlayers.native_quantize) against XLA's.

Payload bits, scales and amaxes must equal `scaling.quantize` / `scaling.amax`
exactly, special values included, and the layers must give the same bits with
the kernel and without it (``QLAYERS_NATIVE_QUANTIZE=0``).
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qlayers import _native
from qlayers import native_quantize
from qlayers import ops
from qlayers import scaling
from qlayers.scaling import QuantSpec

pytestmark = pytest.mark.skipif(
    "qlayers_quantize_fp8_tensor" not in _native.loaded("cpu"),
    reason=_native.unavailable_reason() or "native quantize not built")

_F32 = np.finfo(np.float32)


def _inputs():
  rng = np.random.default_rng(0)
  out = {
      "normal": rng.standard_normal((64, 96)),
      "wide range": rng.standard_normal((3, 4097)) * 1e3,
      "tiny": rng.standard_normal((16, 64)) * 1e-30,
      "huge": rng.standard_normal((16, 64)) * 1e30,
      "subnormal": np.array([1e-39, -2e-39, 5e-40, 0.0, -0.0]),
      "subnormal and normal": np.array([1e-39, -2e-39, 3e-38, 0.0]),
      "zeros": np.zeros((7, 5)),
      "f32 max": np.array([1, -1, 1, -1, 1]) * _F32.max,
      "random bits": rng.integers(0, 2**32, 9000, dtype=np.uint32).view(
          np.float32),
  }
  v = rng.standard_normal(5000)
  v[[3, 77]] = [np.inf, -np.inf]
  out["inf"] = v
  v = rng.standard_normal(5000)
  v[-1], v[10] = np.nan, -np.nan
  out["nan"] = v
  return out


INPUTS = _inputs()
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _as(x, dtype):
  with np.errstate(all="ignore"):
    return jnp.asarray(np.asarray(x, np.float32).astype(dtype))


def _bits(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_amax_equals_xla(name):
  for dtype in DTYPES:
    x = _as(INPUTS[name], dtype)
    want = jax.jit(scaling.amax)(x)
    got = jax.jit(native_quantize.amax)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=f"{name} {dtype.__name__}")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"])
@pytest.mark.parametrize("name", sorted(INPUTS))
def test_quantize_bits_equal_xla(name, fmt):
  """Current scaling (amax of x) and given amaxes, passed at run time as
  delayed scaling does: zero, subnormal, the smallest normals (whose
  multiplier overflows), normal, Inf, NaN."""
  amaxes = np.array([0.0, 1e-39, 2.5e-38, 7.0, np.inf, np.nan], np.float32)
  for dtype, (margin, pow2) in itertools.product(DTYPES,
                                                 ((0, False), (3, True))):
    spec = QuantSpec(format=fmt, granularity="tensor", margin=margin,
                     pow2=pow2)
    x = _as(INPUTS[name], dtype)

    @jax.jit
    def both(x, a, spec=spec):
      return [[(q.payload, q.scale) for q in (
          quantize(x, spec, -1, tensor_amax=a), quantize(x, spec, -1))]
              for quantize in (scaling.quantize, native_quantize.quantize)]

    for a in amaxes:
      want, got = both(x, a)
      where = (f"{name} {dtype.__name__} {fmt} margin={margin} pow2={pow2} "
               f"amax={a}")
      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert w.dtype == g.dtype and w.shape == g.shape, where
        if w.dtype == jnp.float32:
          np.testing.assert_array_equal(np.asarray(g), np.asarray(w),
                                        err_msg=where)
        else:
          np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=where)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("name", sorted(INPUTS))
def test_mx_bits_equal_xla(name, fmt):
  """Blocks along either axis, padding (sizes that are not multiples of 32),
  both E8M0 rules, blocks holding NaN or Inf."""
  x0 = np.asarray(INPUTS[name], np.float32).ravel()
  x0 = np.resize(x0, (33, max(2, x0.size // 33 + 1)))[:, :70]
  for dtype, rule in itertools.product(DTYPES, ("mx_rceil", "mx_floor")):
    spec = QuantSpec(format=fmt, granularity="mx", scale_rule=rule)
    x = _as(x0, dtype)

    @jax.jit
    def both(x, spec=spec):
      return [[(q.payload, q.scale) for q in (quantize(x, spec, 0),
                                              quantize(x, spec, 1))]
              for quantize in (scaling.quantize, native_quantize.quantize)]

    want, got = both(x)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      where = f"{name} {dtype.__name__} {fmt} {rule}"
      assert w.dtype == g.dtype and w.shape == g.shape, where
      np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=where)


def _lowered(fn, *args) -> str:
  return jax.jit(fn).lower(*args).as_text()


def test_the_kernel_is_in_the_cpu_program(monkeypatch):
  spec = QuantSpec(format="e4m3", granularity="tensor")
  x = jnp.ones((8, 16), jnp.bfloat16)
  # A fresh function each time: the switches are read when it is traced.
  fn = lambda: lambda x: native_quantize.quantize(x, spec).payload
  text = _lowered(fn(), x)
  assert "qlayers_quantize_fp8_tensor" in text and "qlayers_amax" in text
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "0")
  assert "qlayers_" not in _lowered(fn(), x)
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "1")
  monkeypatch.setenv("QLAYERS_BACKEND", "xla")
  assert "qlayers_" not in _lowered(fn(), x)
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "maybe")
  with pytest.raises(ValueError, match="QLAYERS_NATIVE_QUANTIZE"):
    native_quantize.applies(x)


@pytest.mark.parametrize("spec,x,why", [
    (QuantSpec(format="e4m3", granularity="mx"), jnp.ones((2, 4, 64)),
     "rank 3"),
    (QuantSpec(format="e2m1", granularity="mx"), jnp.ones((4, 64)),
     "not fp8"),
    (QuantSpec(format="e4m3", granularity="row"), jnp.ones((4, 64)),
     "row granularity"),
    (QuantSpec(format="e4m3", granularity="tensor", rounding="stochastic"),
     jnp.ones((4, 64)), "stochastic"),
    (QuantSpec(format="e4m3", granularity="tensor", scale_rule="deepseek"),
     jnp.ones((4, 64)), "deepseek rule"),
    (QuantSpec(format="e4m3", granularity="tensor"),
     jnp.ones((0, 64)), "non-empty"),
    (QuantSpec(format="e4m3", granularity="tensor"),
     jnp.ones((4, 64), jnp.float8_e5m2), "non-empty float"),
])
def test_what_stays_on_xla(spec, x, why):
  ok, reason = native_quantize.applies(x, spec)
  assert not ok and why in reason


def test_bad_arguments_are_named():
  x = jnp.ones((4, 8))
  with pytest.raises(TypeError, match="fp8 dtype"):
    _native.quantize_fp8_tensor(x, 1.0, jnp.bfloat16)
  with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
    _native.amax(jnp.ones((4,), jnp.int32))
  with pytest.raises(ValueError, match="margin"):
    _native.quantize_fp8_tensor(x, 1.0, jnp.float8_e4m3fn, margin=127)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "mxfp8"])
def test_layer_bits_do_not_depend_on_the_kernel(name, monkeypatch):
  """Outputs, gradients and delayed state of a quantized matmul with leading
  dims, with and without the kernel."""
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (2, 24, 64), jnp.bfloat16)
  w = jax.random.normal(kw, (64, 48), jnp.float32) * 0.1
  g = jax.random.normal(kg, (2, 24, 48), jnp.float32)
  state = ops.init_state(name)
  if state is not None:  # a history, so the delayed scale is used
    state = jax.tree.map(lambda s: s.at[..., 0].set(3.0) if s.ndim else s,
                         state)

  def run():
    def loss(x, w, state):
      y, new_state = ops.quantized_matmul(x, w, name, state=state)
      return jnp.sum(y.astype(jnp.float32) * g), (y, new_state)
    grads, (y, new_state) = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(
        x, w, state)
    return y, grads, new_state

  lowered = jax.jit(lambda x, w: ops.quantized_matmul(
      x, w, name, state=state)[0]).lower(x, w).as_text()
  assert ("qlayers_quantize_mx" if name == "mxfp8"
          else "qlayers_quantize_fp8_tensor") in lowered
  native = run()
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "0")
  reference = run()
  chex.assert_trees_all_equal(native, reference)


def test_history_max_equals_jnp_max():
  """Delayed scaling only compares it with zero and uses it when positive:
  equal values (zeros of either sign), NaN for a history holding NaN."""
  rng = np.random.default_rng(1)
  cases = [rng.uniform(0, 5, 1024), np.zeros(16), np.array([-0.0, 0.0]),
           np.array([-3.0, -1.0]), np.array([1e-39, 0.0]),
           np.array([2.0, np.nan, 1.0]), np.array([np.inf, 1.0]),
           rng.standard_normal(7)]
  fn = jax.jit(lambda h: (native_quantize.history_max(h), jnp.max(h)))
  for h in cases:
    got, want = map(np.asarray, fn(jnp.asarray(h, jnp.float32)))
    assert (got == want) or (np.isnan(got) and np.isnan(want)), (h, got, want)
  text = jax.jit(native_quantize.history_max).lower(
      jnp.zeros(8, jnp.float32)).as_text()
  assert "qlayers_max_f32" in text

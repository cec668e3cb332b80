"""The native per-tensor FP8 quantize (qlayers.native_quantize) against XLA's.

Payload bits, scales and amaxes must equal `scaling.quantize` / `scaling.amax`
exactly, special values included, and the layers must give the same bits with
the kernel and without it (``QLAYERS_NATIVE_QUANTIZE=0``).
"""

import itertools
import re

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
  return np.asarray(a).reshape(-1).view(np.uint8)


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
  assert {"mxfp8": "qlayers_quantize_mx",
          "fp8_delayed": "qlayers_quantize_fp8_delayed"}.get(
              name, "qlayers_quantize_fp8_tensor") in lowered
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


def _mx_tensor(rng, fmt, axis, shape, block=32):
  """A QTensor of random payload bits (NaN and Inf codes included) and
  random E8M0 codes (0, 0xFF and a band of ordinary ones)."""
  dtype = jnp.float8_e4m3fn if fmt == "e4m3" else jnp.float8_e5m2
  r, c = shape
  padded = (-(-r // block) * block, c) if axis == 0 else (r, -(-c // block) * block)
  grid = (padded[0] // block, c) if axis == 0 else (r, padded[1] // block)
  payload = jax.lax.bitcast_convert_type(
      jnp.asarray(rng.integers(0, 256, padded, dtype=np.uint8)), dtype)
  codes = rng.integers(0, 256, grid).astype(np.uint8)
  ordinary = rng.random(grid) < 0.7
  codes[ordinary] = rng.integers(100, 150, grid)[ordinary]
  blocks = (block, 1) if axis == 0 else (1, block)
  return scaling.QTensor(payload, jnp.asarray(codes), fmt, "mx", blocks, axis,
                         shape)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(64, 96), (70, 33), (1, 1), (257, 130)])
def test_mx_dequantize_bits_equal_xla(fmt, axis, shape):
  """Every payload code (NaN, Inf, subnormals) under every kind of E8M0
  code (0 reads as zero under DAZ, 0xFF is NaN), padding cropped, and the
  transposed copy."""
  q = _mx_tensor(np.random.default_rng(sum(shape) + axis), fmt, axis, shape)
  assert native_quantize.dequantizes(q)
  want = jax.jit(lambda q: q.dequantize(jnp.bfloat16))(q)
  for transpose in (False, True):
    got = jax.jit(lambda q, t=transpose: native_quantize.dequantize(
        q, transpose=t))(q)
    ref = want.T if transpose else want
    assert got.dtype == jnp.bfloat16 and got.shape == ref.shape
    np.testing.assert_array_equal(_bits(got), _bits(ref),
                                  err_msg=f"{fmt} axis {axis} {shape} "
                                          f"transpose={transpose}")


def test_mx_dequantize_in_the_gemm_program(monkeypatch):
  """The CPU MX GEMM dequantizes both operands natively (one of them
  transposed for Wgrad), and not with either switch off."""
  x = jnp.ones((64, 96), jnp.bfloat16)
  w = jnp.ones((96, 64), jnp.float32)
  fn = lambda: jax.value_and_grad(lambda x, w: jnp.sum(  # noqa: E731
      ops.quantized_matmul(x, w, "mxfp8")[0].astype(jnp.float32)), (0, 1))
  text = _lowered(fn(), x, w)
  assert text.count("qlayers_dequantize_mx") == 6
  assert "transpose = true" in text
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "0")
  assert "qlayers_" not in _lowered(fn(), x, w)
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "1")
  text = jax.jit(lambda x, w: jax.grad(lambda x, w: jnp.sum(
      ops.quantized_matmul(x, w, "mxfp8", backend="xla")[0].astype(
          jnp.float32)), (0, 1))(x, w)).lower(x, w).as_text()
  assert "qlayers_dequantize_mx" not in text


def test_mx_dequantize_bad_arguments_are_named():
  q = _mx_tensor(np.random.default_rng(0), "e4m3", 1, (4, 64))
  with pytest.raises(ValueError, match="do not hold"):
    _native.dequantize_mx(q.payload, q.scale, (4, 96), axis=1)
  with pytest.raises(TypeError, match="uint8"):
    _native.dequantize_mx(q.payload, q.scale.astype(jnp.int32), (4, 64),
                          axis=1)
  with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
    _native.dequantize_mx(q.payload.astype(jnp.bfloat16), q.scale, (4, 64),
                          axis=1)
  packed = scaling.quantize(jnp.ones((4, 64)), QuantSpec(
      format="e2m1", granularity="mx"), 1)
  assert not native_quantize.dequantizes(packed)


_HISTORIES = {
    "empty": np.zeros(16),
    "seen": np.r_[0.0, 3.5, 1.0, np.zeros(13)],
    "subnormal": np.r_[1e-39, np.zeros(15)],
    "nan": np.r_[np.nan, 2.0, np.zeros(14)],
    "inf": np.r_[np.inf, np.zeros(15)],
}
_RUNNING = {"zero": 0.0, "-zero": -0.0, "subnormal": 2e-39, "big": 7.0,
            "small": 1e-3, "nan": np.nan}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("name", sorted(INPUTS))
def test_delayed_quantize_bits_equal_xla(name, fmt):
  """The fused delayed use against `scaling.delayed_amax` + `quantize`:
  first step (empty history), a seen history, subnormal/NaN/Inf entries,
  running amaxes of every kind, operands holding Inf/NaN/subnormals."""
  fn = jax.jit(lambda x, h, r, spec: (
      native_quantize.quantize_delayed(x, spec, h, r),
      (lambda ar: (scaling.quantize(x, spec, tensor_amax=ar[0]), *ar))(
          scaling.delayed_amax(scaling.ScaleState(h, r), scaling.amax(x)))),
               static_argnums=3)
  for dtype, (hname, h), (rname, r), (margin, pow2) in itertools.product(
      DTYPES, _HISTORIES.items(), _RUNNING.items(), [(0, False), (2, True)]):
    spec = QuantSpec(format=fmt, granularity="tensor", margin=margin,
                     pow2=pow2)
    x = _as(INPUTS[name], dtype)
    assert native_quantize.fuses_delayed(x, spec, jnp.zeros(16))
    (q, use, run), (qr, use_r, run_r) = fn(
        x, jnp.asarray(h, jnp.float32), jnp.float32(r), spec)
    where = f"{name} {dtype.__name__} history {hname} running {rname} {spec}"
    for got, want in ((q.payload, qr.payload), (q.scale, qr.scale),
                      (use, use_r), (run, run_r)):
      assert got.dtype == want.dtype and got.shape == want.shape, where
      np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=where)


def test_delayed_quantize_in_the_layer_program(monkeypatch):
  """One fused kernel per delayed role use (x, w forward; g backward), and
  none with the switch off or for the most_recent algorithm."""
  x = jnp.ones((2, 8, 64), jnp.bfloat16)
  w = jnp.ones((64, 32), jnp.float32)

  def lowered(recipe):
    return jax.jit(jax.value_and_grad(lambda x, w, state: jnp.sum(
        ops.quantized_matmul(x, w, recipe, state=state)[0].astype(
            jnp.float32)), (0, 1, 2))).lower(
                x, w, ops.init_state(recipe)).as_text()

  assert lowered("fp8_delayed").count("qlayers_quantize_fp8_delayed") == 3
  most_recent = ops.load_recipe("fp8_delayed").replace(
      amax_compute_algo="most_recent")
  assert "qlayers_quantize_fp8_delayed" not in lowered(most_recent)
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "0")
  assert "qlayers_" not in lowered("fp8_delayed")


def test_delayed_quantize_bad_arguments_are_named():
  x = jnp.ones((4, 8))
  with pytest.raises(ValueError, match="1-D"):
    _native.quantize_fp8_delayed(x, jnp.zeros((2, 3)), 0.0,
                                 jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="fp8 dtype"):
    _native.quantize_fp8_delayed(x, jnp.zeros(4), 0.0, jnp.float32)
  assert not native_quantize.fuses_delayed(
      x, QuantSpec(format="e4m3", granularity="tensor"), jnp.zeros(4),
      algo="most_recent")


def test_end_step_bits_equal_xla():
  """Every role's new history (and cleared amax) against
  `scaling.update_scales` after the gradient merge, for running and gradient amaxes of every kind (NaN, Inf,
  -0, subnormals, which XLA's max reads as zeros), and histories of
  several lengths."""
  kinds = [0.0, -0.0, 1e-39, -1e-39, 3.0, 0.5, np.inf, -np.inf, np.nan]
  pairs = list(itertools.product(kinds, kinds))
  rng = np.random.default_rng(2)
  states = [scaling.ScaleState(
      jnp.asarray(rng.uniform(0, 4, 1 + i % 5), jnp.float32), jnp.float32(a))
            for i, (a, _) in enumerate(pairs)]
  states += [scaling.ScaleState(jnp.zeros(3, jnp.float32), jnp.float32(a))
             for a in kinds]
  grads = [jnp.float32(m) for _, m in pairs]
  got, cleared = jax.jit(native_quantize.end_step)(states, grads)
  assert len(got) == len(cleared) == len(states)
  for a in cleared:  # +0.0, as `scaling.update_scales` clears it
    chex.assert_shape(a, ())
    np.testing.assert_array_equal(_bits(a), _bits(jnp.float32(0.0)))
  for i, st in enumerate(states):
    a = st.amax
    if i < len(grads):
      a = jnp.maximum(a, jnp.where(jnp.isfinite(grads[i]), grads[i], 0.0))
    want = jax.jit(scaling.update_scales)(st._replace(amax=a)).amax_history
    np.testing.assert_array_equal(_bits(got[i]), _bits(want),
                                  err_msg=f"role {i}: {pairs[i % len(pairs)]}")
  assert "qlayers_end_step" in _lowered(native_quantize.end_step, states,
                                        grads)


def test_update_scales_is_one_kernel_and_the_same_state(monkeypatch):
  """`qlayers.update_scales` of a model ends every role's step in one
  call, and a few training steps leave the same state with it as without."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import qlayers  # pylint: disable=g-import-not-at-top

  class Two(nnx.Module):
    def __init__(self):
      self.a = qlayers.QuantDense(64, 32, recipe="fp8_delayed",
                                  rngs=nnx.Rngs(0))
      self.b = nnx.List([qlayers.QuantDense(32, 16, recipe="fp8_delayed",
                                            rngs=nnx.Rngs(1))])

    def __call__(self, x):
      return self.b[0](self.a(x))

  def train():
    model = Two()
    loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731

    @nnx.jit
    def step(model, x):
      _, grads = qlayers.value_and_grad(loss)(model, x)
      qlayers.update_scales(model, grads)

    for i in range(3):
      step(model, jax.random.normal(jax.random.key(i), (4, 64)) * (i + 1))
    lowered = nnx.jit(step).lower(model, jnp.ones((4, 64)))
    return (nnx.state(model, qlayers.QuantVariable), lowered.as_text(),
            lowered.compile().as_text())

  native, text, optimized = train()
  assert text.count("qlayers_end_step") == 1
  # The kernel writes the cleared running amaxes: XLA copies no zero into
  # the step's outputs, one per role, as it does for `jnp.zeros_like`.
  assert not re.search(r"f32\[\] copy\(%constant", optimized), optimized
  assert float(native["b"][0]["quant"]["g_amax_history"][...][2]) > 0
  monkeypatch.setenv("QLAYERS_NATIVE_QUANTIZE", "0")
  reference, text, _ = train()
  assert "qlayers_end_step" not in text
  chex.assert_trees_all_equal(native, reference)


def test_the_xla_branch_is_traced_only_where_a_gpu_can_be_the_target(
    monkeypatch):
  """On a CPU host with no GPU target only the kernel is traced (the
  program is lowered for CPU alone); naming a GPU target brings back the
  per-platform choice, whose non-CPU branch is XLA's form."""
  x = jnp.linspace(-3.0, 5.0, 64, dtype=jnp.float32).reshape(8, 8)
  # A new function each time: a trace of the same one would be reused.
  jaxpr = lambda: str(jax.make_jaxpr(lambda v: native_quantize.amax(v))(x))  # noqa: E731
  monkeypatch.delenv("QLAYERS_GPU_ARCH", raising=False)
  cpu_only = jaxpr()
  assert "platform_index" not in cpu_only and "ffi_call" in cpu_only
  monkeypatch.setenv("QLAYERS_GPU_ARCH", "sm_90")
  both = jaxpr()
  assert "platform_index" in both and "ffi_call" in both
  np.testing.assert_array_equal(jax.jit(native_quantize.amax)(x), 5.0)
